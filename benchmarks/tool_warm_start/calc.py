"""Prototype of the tiny-calc built-in model (scratch; ported into colocate_rl/builtin_model.py when it works)."""

from __future__ import annotations

import ast
import json
import operator
import random
import time
from pathlib import Path

import torch

from colocate_rl import builtin_model as bm
from colocate_rl.prompts import iter_builtin_rows

TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with +, -, * and / on numbers.

    Args:
        expression: The arithmetic expression to evaluate.

    Returns:
        The result, as a string.
    """

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"not an arithmetic expression: {expression!r}")

    if not isinstance(expression, str) or len(expression) > 200:
        raise ValueError("expression must be a short string")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    value = ev(tree)
    if isinstance(value, float):
        value = int(value) if value.is_integer() else round(value, 6)
    return str(value)


def qwen25_template() -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text(encoding="utf-8")


def expr_of(q):
    """The expression as written in the question: "a op b"."""
    expr = q.split("is ", 1)[-1] if q.startswith("What is") else q.split(" ", 1)[1] if q[0].isalpha() else q
    return expr.rstrip("?.")


FMT = "plain"


def final(expr, result):
    if FMT == "restate":
        return f"{expr} = {result}. The answer is {result}."
    return f"The answer is {result}."


def chats(n: int, seed, tool_share: float, op_share: dict | None = None) -> list[tuple[list[dict], bool]]:
    """Warm-start conversations: (messages, uses_tool)."""
    rng = random.Random(f"tiny-calc-warm:{seed}")
    rows = iter_builtin_rows("arithmetic", f"tiny-calc-warm:{seed}")
    out = []
    for _ in range(n):
        row = next(rows)
        q = row["prompt"]
        expr = expr_of(q)
        share = tool_share if op_share is None else op_share[[o for o in "+-*" if f" {o} " in expr][0]]
        msgs = [{"role": "user", "content": q}]
        use = rng.random() < share
        if use:
            result = calculator(expr)
            assert result == row["answer"], (q, expr, result)
            call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expr}}}
            msgs += [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "calculator", "content": result},
                {"role": "assistant", "content": final(expr, result)},
            ]
        else:
            msgs.append({"role": "assistant", "content": final(expr, row["answer"])})
        out.append((msgs, use))
    return out


def render(msgs, add_generation_prompt=False, tools=True):
    from transformers.utils.chat_template_utils import render_jinja_template

    text = render_jinja_template(
        conversations=[msgs],
        tools=[calculator] if tools else None,
        chat_template=qwen25_template(),
        add_generation_prompt=add_generation_prompt,
    )
    return text[0][0] if isinstance(text, tuple) else text[0]


def train_tokenizer(out_dir: Path, vocab: int, n_chats: int = 400) -> None:
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=bm.SPECIAL_TOKENS + TOOL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
    )
    corpus = bm._corpus() + [render(m) for m, _ in chats(n_chats, "tokenizer", 0.5)]
    tok.train_from_iterator(corpus, trainer)
    spec = json.loads(tok.to_str())
    for t in spec["added_tokens"]:
        if t["content"] in TOOL_TOKENS:
            t["special"] = False  # as Qwen2.5 ships them: kept in decoded text (vLLM/TRL skip special tokens)
    tok = Tokenizer.from_str(json.dumps(spec))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=bm.EOS,
        pad_token=bm.PAD,
        bos_token=None,
        additional_special_tokens=[bm.BOS_START],
        model_max_length=2048,
    )
    fast.save_pretrained(str(out_dir))
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = qwen25_template()
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg["additional_special_tokens"] = cfg.pop("extra_special_tokens", [bm.BOS_START])
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def encode(tok, msgs, uses_tool, tools=True):
    """(ids, loss mask): the assistant's own tokens (with its <|im_end|>), as TRL's tool loop concatenates them."""

    def ids(m, gen=False):
        return tok(render(m, gen, tools), add_special_tokens=False).input_ids

    full = ids(msgs)
    mask = [0] * len(full)
    spans = []
    if uses_tool:
        p0, c1, p1 = ids(msgs[:1], True), ids(msgs[:2]), ids(msgs[:3], True)
        spans = [(len(p0), len(c1) - 1), (len(p1), len(full) - 1)]
        assert full[: len(p1)] == p1 and full[: len(c1)] == c1
    else:
        p0 = ids(msgs[:1], True)
        spans = [(len(p0), len(full) - 1)]
    assert full[: len(p0)] == p0
    for a, b in spans:
        for i in range(a, b):
            mask[i] = 1
    return full[:-1], mask[:-1]  # drop the trailing "\n" after the last <|im_end|>


def build(
    out_dir: Path,
    seed=0,
    hidden=64,
    layers=2,
    vocab=512,
    n=2000,
    tool_share=0.3,
    op_share=None,
    steps=300,
    batch=32,
    lr=3e-3,
    emb_scale=8.0,
    log=True,
    heads=4,
    kv_heads=2,
    rope_theta=1000000.0,
    probe_every=0,
    short_frac=0.0,
    detach_prefix=False,
    copy_steps=0,
    copy_batch=32,
    copy_lr=None,
):
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    t0 = time.time()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out_dir, vocab)
    tok = bm.load_tokenizer(out_dir)
    t_tok = time.time() - t0
    c = dict(
        bm.LAYOUTS["tiny"],
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rope_theta=rope_theta,
        intermediate_size=2 * hidden,
        vocab_size=vocab,
        max_window_layers=layers,
    )
    config = Qwen2Config(**c, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(emb_scale)
    cs = chats(n, seed, tool_share, op_share)
    data = [encode(tok, m, u) for m, u in cs]
    data_short = [encode(tok, m, u, tools=False) for m, u in cs] if short_frac else None
    t_data = time.time() - t0 - t_tok
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps))

    # Every sequence starts with the same system prompt (the tool list): run it once per step at batch 1 and share
    # its KV cache across the batch (exact gradients: the shared prefix's backward sums over the batch).
    def common(data):
        P = 0
        while all(len(d[0]) > P and d[0][P] == data[0][0][P] for d in data[:50]):
            P += 1
        assert all(d[0][:P] == data[0][0][:P] and not any(d[1][:P]) for d in data)
        return P, torch.tensor([data[0][0][:P]])

    sets = [(data,) + common(data)]
    if short_frac:
        sets.append((data_short,) + common(data_short))
    model.train()
    if copy_steps:
        copy_pretrain(model, seed, copy_steps, copy_batch, copy_lr or lr, probe_every, tok, t0)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps))
    for step in range(steps):
        dset, P, prefix = sets[1] if short_frac and step < short_frac * steps else sets[0]
        idx = torch.randint(len(dset), (batch,), generator=g).tolist()
        L = max(len(dset[i][0]) for i in idx) - P
        x = torch.zeros(batch, L, dtype=torch.long)
        y = torch.full((batch, L), -100, dtype=torch.long)
        att = torch.zeros(batch, P + L, dtype=torch.long)
        att[:, :P] = 1
        for r, i in enumerate(idx):
            ids, m = dset[i][0][P:], dset[i][1][P:]
            x[r, : len(ids)] = torch.tensor(ids)
            att[r, P : P + len(ids)] = 1
            lab = torch.tensor([t if k else -100 for t, k in zip(ids, m)])
            y[r, : len(ids) - 1] = lab[1:]
        if detach_prefix:
            with torch.no_grad():
                out0 = model(input_ids=prefix, use_cache=True)
        else:
            out0 = model(input_ids=prefix, use_cache=True)
        cache = getattr(out0, "cache", None) or out0.past_key_values
        cache.batch_repeat_interleave(batch)
        logits = model(input_ids=x, attention_mask=att, cache=cache, use_cache=True).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if probe_every and (step + 1) % probe_every == 0:
            print(f"  step {step + 1} t={time.time() - t0:.1f}s loss {loss.item():.3f}", probe(model, tok), flush=True)
        if log and (step % 50 == 0 or step == steps - 1):
            print(f"  sft step {step} loss {loss.item():.3f} t={time.time() - t0:.1f}s", flush=True)
    model.eval()
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(str(out_dir))
    t_all = time.time() - t0
    if log:
        print(f"  build: tokenizer {t_tok:.1f}s data {t_data:.1f}s total {t_all:.1f}s, seq len ~{len(data[0][0])}")
    return out_dir, t_all


_PROBE = None


@torch.no_grad()
def probe(model, tok, n=48):
    """Teacher-forced greedy accuracy on fresh tool chats: (expression digits all right, result copy all right)."""
    global _PROBE
    if _PROBE is None:
        data = [encode(tok, m, True) for m, _ in chats(n, "probe", 1.0)]
        resp = tok.convert_tokens_to_ids("</tool_response>")
        digits = {tok.convert_tokens_to_ids(str(i)) for i in range(10)}
        _PROBE = (data, resp, digits)
    data, resp, digits = _PROBE
    model.eval()
    e_ok = a_ok = 0
    for ids, mask in data:
        pred = model(input_ids=torch.tensor([ids])).logits[0].argmax(-1).tolist()
        e = [pred[i - 1] == ids[i] for i in range(1, len(ids)) if mask[i] and ids[i] in digits and resp not in ids[:i]]
        a = [pred[i - 1] == ids[i] for i in range(1, len(ids)) if mask[i] and ids[i] in digits and resp in ids[:i]]
        e_ok += all(e)
        a_ok += all(a)
    model.train()
    return f"expr {e_ok / len(data):.2f} result {a_ok / len(data):.2f}"


def copy_pretrain(model, seed, steps, batch, lr, probe_every, tok, t0):
    """Induction warm-up: random token strings shown twice, LM loss on the second copy."""
    g = torch.Generator().manual_seed(seed + 1000)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    V = model.config.vocab_size
    for step in range(steps):
        n = int(torch.randint(6, 20, (1,), generator=g))
        s = torch.randint(7, V, (batch, n), generator=g)
        x = torch.cat([s, s], 1)
        y = torch.full_like(x, -100)
        y[:, n:-1] = x[:, n + 1 :]
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if probe_every and (step + 1) % probe_every == 0:
            acc = (logits.argmax(-1)[:, n:-1] == x[:, n + 1 :]).float().mean().item()
            print(f"  copy step {step + 1} t={time.time() - t0:.1f}s loss {loss.item():.3f} acc {acc:.2f}", flush=True)


from colocate_rl.tools import calculator  # noqa: E402,F811  (the project tool: same name, signature, docstring)
