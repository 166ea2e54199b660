"""The training data's longest prompt in tokens, as the ranks will tokenize it (the model's own tokenizer and chat
template, the recipe's system prompt, TRL's generation prompt), for the memory estimate: prompts are often far
shorter than generation.max_model_length less the completion, which the estimate otherwise assumes (GSM8K-style
prompts with SmolLM2's template: at most 181 tokens where 512 were assumed, and the estimate of a 256-completion step
fell from 123.4 to 91.5 GiB against 91.3 measured).

Measured only where it can be here, before launch, without downloading: a local model directory (its tokenizer files)
or a built-in model (its tokenizer trained here as its build trains it, `builtin_model.bpe_tokenizer`) with a built-in
task or a local data file. A hub model or dataset, `model.chat_template` or tools (they change the rendered prompt)
give None: the estimate keeps its assumption. Files are read whole up to MAX_ROWS rows; of more rows than TOKENIZED,
the longest by characters are tokenized. Never raises: a file or tokenizer that cannot be read gives None (validation
reports the file itself).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

MAX_ROWS = 1_000_000  # rows read of a data file (a longer file: the longest of these, said in `line`)
TOKENIZED = 20_000  # rows tokenized: all of a smaller file, else the longest by characters (~5 s per 20,000)


@dataclass(frozen=True)
class LongestPrompt:
    tokens: int  # the longest prompt in tokens
    rows: int  # rows read
    complete: bool  # every row of the data was read

    def line(self, source: str) -> str:
        part = f"all {self.rows:,} rows" if self.complete else f"the first {self.rows:,} rows"
        return f"{self.tokens} tokens, the longest prompt of {source} ({part}, the model's chat template)"


def _prompt_values(source: str, field: str, num_samples: int | None, seed: int) -> tuple[list, bool] | None:
    """The `field` values of the rows the ranks train on (num_samples: the first ones), whether that is all of them;
    None for data not read here."""
    from colocate_rl.prompts import DEFAULT_BUILTIN_SIZE, builtin_rows, source_kind

    limit = min(num_samples or MAX_ROWS, MAX_ROWS)
    if source_kind(source) == "builtin":
        rows = builtin_rows(source.split(":", 1)[1], num_samples or DEFAULT_BUILTIN_SIZE, seed)
        return [r.get(field) for r in rows], True
    path = os.path.expanduser(source)
    if source_kind(source) != "file" or not os.path.isfile(path):
        return None
    if path.lower().endswith(".parquet"):
        import pyarrow.parquet as pq

        table = pq.ParquetFile(path)
        values = table.read(columns=[field]).column(field).to_pylist()[:limit]
        return values, len(values) == table.metadata.num_rows or len(values) == num_samples
    with open(path, encoding="utf-8") as f:
        if f.read(4096).lstrip().startswith("["):  # a JSON list of rows (else JSON Lines, as datasets reads both)
            f.seek(0)
            rows = json.load(f)
            return [r.get(field) for r in rows[:limit]], len(rows) <= limit or limit == num_samples
        f.seek(0)
        values = []
        for line in f:
            if line.strip():
                if len(values) == limit:
                    return values, limit == num_samples
                values.append(json.loads(line).get(field))
        return values, True


def longest_prompt(recipe, model_dir: str | None = None, builtin_layout: str | None = None) -> LongestPrompt | None:
    """The longest prompt of `recipe`'s training data with the tokenizer in `model_dir`, or the built-in layout's
    (see the module docstring)."""
    from colocate_rl.prompts import to_prompt

    d = recipe.data
    if recipe.model.chat_template is not None or recipe.tools.active:
        return None
    try:
        found = _prompt_values(d.source, d.prompt_field, d.num_samples, recipe.trainer.seed)
        if not found or not found[0]:
            return None
        values, complete = found
        prompts = [to_prompt(v, i, d.prompt_field, d.chat, d.system_prompt) for i, v in enumerate(values)]
        if len(prompts) > TOKENIZED:
            prompts = sorted(prompts, key=_characters, reverse=True)[:TOKENIZED]
        if builtin_layout is not None:
            ids = _builtin_ids(builtin_layout, prompts, d.chat)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            if d.chat:
                texts = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, tokenize=False)
                ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
            else:
                ids = tokenizer(prompts)["input_ids"]
    except Exception:  # unreadable here: the estimate keeps its assumption, validation names the file's problem
        return None
    return LongestPrompt(max(len(x) for x in ids), len(values), complete)


def _builtin_ids(layout: str, prompts: list, chat: bool) -> list[list[int]]:
    """Token ids of `prompts` as the ranks tokenize them for built-in `layout`, without importing transformers (1.4 s):
    its BPE (`builtin_model.bpe_tokenizer`, no special tokens added, as its tokenizer adds none) and its chat template
    rendered as transformers renders one (jinja2's sandbox, trim_blocks, lstrip_blocks, loopcontrols); the tests
    compare both with transformers."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from colocate_rl.builtin_model import bpe_tokenizer, layout_chat_template

    if chat:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        template = env.from_string(layout_chat_template(layout))
        prompts = [template.render(messages=p, add_generation_prompt=True) for p in prompts]
    return [e.ids for e in bpe_tokenizer(layout).encode_batch(prompts, add_special_tokens=False)]


def _characters(prompt) -> int:
    return len(prompt) if isinstance(prompt, str) else sum(len(str(m.get("content", ""))) for m in prompt)
