"""The supervised warm start of the built-in tool-use model `builtin:tiny-calc` (built by `colocate_rl.builtin_model`).

What it is: about half a minute of plain supervised fine-tuning (AdamW, CPU, deterministic per seed) of a random-init
`tiny`-shaped Qwen2 on synthetic chats for `builtin:arithmetic` questions, rendered exactly as TRL's GRPOTrainer
renders them: TRL's Qwen2.5 template with the `calculator` tool (`colocate_rl.tools.calculator`, whose JSON schema
`CALCULATOR_SCHEMA` copies) listed in the system prompt, no other system message. It stands in for the instruct
model real RL starts from; what RL then has to learn is left out on purpose. Loss on the assistant's tokens only.

1. Format (`attempt_steps` to `max_steps` steps): tool transcripts only. User question -> assistant `<tool_call>` to
   `calculator` with the question's expression -> the tool's result -> "The answer is <result>.". The model learns
   the call's JSON and to copy numbers (the expression from the question, the result into the answer). A model this
   small learns to copy abruptly and not from every initialisation: 32 fresh transcripts are probed every
   `probe_every` steps (teacher-forced: are all digits of the expression / of the answer right?); an attempt whose
   expression copies have not formed (`formed`) by `attempt_steps` is restarted from the next initialisation, at
   most `attempts` times, and the best attempt is kept. The initialisations are 0, 1, 2, … whatever the build seed
   (which picks the chats): whether the copy forms depends mostly on the initialisation; init 0 formed by step 250
   for build seeds 0, 1 and 2 here, while inits derived from the build seed failed all three attempts for seed 1.
2. Calibration (`calib_steps`): a mix in which most chats answer directly with the true number (which the model
   cannot compute) and only a minority call the calculator (`calib_tool_share`, by operator: most multiplications,
   few additions and subtractions). So the warm model calls the tool for some questions only and answers the rest
   wrongly; GRPO has to discover that calling it pays.

The questions come from a stream of their own (the arithmetic generator of `colocate_rl.prompts`, copied: this module
sits below it) and skip the first `exclude_heldout` prompts of the seed's held-out stream, which evaluation uses.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

CALCULATOR_SCHEMA = {  # transformers' get_json_schema(colocate_rl.tools.calculator), key order included
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with +, -, * and / on numbers.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "The arithmetic expression to evaluate."}},
            "required": ["expression"],
        },
        "return": {"type": "string", "description": "The result, as a string."},
    },
}
_TEMPLATES = ["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "Calculate {a} {op} {b}.", "{a} {op} {b}?"]
ANSWER = "The answer is {}."


def arithmetic_rows(seed: int | str) -> Iterator[dict]:
    """`colocate_rl.prompts.iter_builtin_rows("arithmetic", seed)`, row for row: {"prompt", "answer"}."""
    rng = random.Random(f"arithmetic:{seed}")
    while True:
        op = rng.choice("+-*")
        a, b = (rng.randint(2, 99), rng.randint(2, 12)) if op == "*" else (rng.randint(1, 99), rng.randint(1, 99))
        a, b = (max(a, b), min(a, b)) if op == "-" else (a, b)
        result = a + b if op == "+" else a - b if op == "-" else a * b
        yield {"prompt": rng.choice(_TEMPLATES).format(a=a, op=op, b=b), "answer": str(result)}


def expression(question: str) -> str:
    """The arithmetic of an arithmetic question: "What is 17 + 25?" -> "17 + 25"."""
    for head in ("What is ", "Compute ", "Calculate "):
        question = question.removeprefix(head)
    return question.rstrip("?.")


def chat(question: str, answer: str, *, call_tool: bool) -> list[dict]:
    """One warm-start conversation: the question, then either the calculator call, its result and "The answer is
    <result>.", or the answer given directly."""
    messages = [{"role": "user", "content": question}]
    if not call_tool:
        return messages + [{"role": "assistant", "content": ANSWER.format(answer)}]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression(question)}}}
    return messages + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": answer},
        {"role": "assistant", "content": ANSWER.format(answer)},
    ]


def render(conversations: list[list[dict]], template: str) -> list[str]:
    """The conversations as the template renders them with the calculator listed."""
    from transformers.utils.chat_template_utils import render_jinja_template

    out = render_jinja_template(conversations=conversations, tools=[CALCULATOR_SCHEMA], chat_template=template)
    return out[0] if isinstance(out, tuple) else out


def transcripts(n: int, seed: int | str, template: str) -> list[str]:
    """`n` rendered chats, half of them calling the tool, for the tokenizer's training corpus."""
    rng, rows = random.Random(f"tiny-calc-corpus:{seed}"), arithmetic_rows(f"tiny-calc-corpus:{seed}")
    convs = []
    for _ in range(n):
        row = next(rows)
        convs.append(chat(row["prompt"], row["answer"], call_tool=rng.random() < 0.5))
    return render(convs, template)


def _encode(tok, convs: list[list[dict]], template: str) -> list[tuple[list[int], list[int]]]:
    """(ids, mask) per conversation, as TRL's tool loop concatenates them: mask 1 on the assistant's own tokens (its
    `<|im_end|>` included), 0 on the prompt and on the tool result."""
    head = tok("<|im_start|>assistant\n", add_special_tokens=False).input_ids
    end = tok.convert_tokens_to_ids("<|im_end|>")
    out = []
    for ids in tok(render(convs, template), add_special_tokens=False).input_ids:
        ids, mask, i = ids[:-1], [0] * (len(ids) - 1), 0  # the "\n" after the last <|im_end|> is not generated
        while i < len(ids):
            if ids[i : i + len(head)] == head:
                i += len(head)
                while ids[i] != end:
                    mask[i] = 1
                    i += 1
                mask[i] = 1
            i += 1
        out.append((ids, mask))
    return out


class _Batches:
    """Random batches of encoded chats. Every chat starts with the same system prompt (the tool list): it is run once
    per step at batch 1 and its KV cache shared by the batch (the gradient is exact: the prefix's backward sums over
    the batch)."""

    def __init__(self, data, batch: int, generator):
        import torch

        self.data, self.batch, self.g = data, batch, generator
        n = min(len(d[0]) for d in data)
        self.p = next((i for i in range(n) if any(d[0][i] != data[0][0][i] for d in data)), n)
        self.prefix = torch.tensor([data[0][0][: self.p]])

    def tensors(self, rows):
        import torch

        p, width = self.p, max(len(self.data[i][0]) for i in rows) - self.p
        x = torch.zeros(len(rows), width, dtype=torch.long)
        y = torch.full((len(rows), width), -100, dtype=torch.long)
        att = torch.zeros(len(rows), p + width, dtype=torch.long)
        att[:, :p] = 1
        for r, i in enumerate(rows):
            ids, mask = self.data[i][0][p:], self.data[i][1][p:]
            x[r, : len(ids)] = torch.tensor(ids)
            att[r, p : p + len(ids)] = 1
            y[r, : len(ids) - 1] = torch.tensor([t if m else -100 for t, m in zip(ids[1:], mask[1:])])
        return x, y, att

    def logits(self, model, x, att):
        cache = model(input_ids=self.prefix, use_cache=True).past_key_values
        cache.batch_repeat_interleave(x.shape[0])
        return model(input_ids=x, attention_mask=att, past_key_values=cache, use_cache=True).logits

    def draw(self):
        import torch

        return self.tensors(torch.randint(len(self.data), (self.batch,), generator=self.g).tolist())


def _train(model, batches: _Batches, steps: int, lr: float, schedule, stop=None) -> int:
    """AdamW on the masked next-token loss; `stop(step)` (every step) may end it early. Returns the steps taken."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    model.train()
    for step in range(steps):
        x, y, att = batches.draw()
        logits = batches.logits(model, x, att)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if stop is not None and stop(step + 1):
            return step + 1
    return steps


def _probe(model, probe: _Batches, digits: set[int], result_start: int) -> tuple[float, float]:
    """Teacher-forced greedy on the probe chats: the share whose expression digits, and whose answer digits, are all
    predicted right."""
    import torch

    model.eval()
    with torch.no_grad():
        x, y, att = probe.tensors(list(range(len(probe.data))))
        pred = probe.logits(model, x, att).argmax(-1)
    model.train()
    expr = answer = 0
    for r in range(x.shape[0]):
        row, after = x[r].tolist(), False
        ok = [True, True]
        for i in range(x.shape[1] - 1):
            after = after or row[i] == result_start
            if y[r, i] != -100 and int(y[r, i]) in digits:
                ok[after] &= bool(pred[r, i] == y[r, i])
        expr += ok[0]
        answer += ok[1]
    return expr / x.shape[0], answer / x.shape[0]


def warm_start(new_model, tok, template: str, spec: dict, seed: int, log=None) -> tuple[object, dict]:
    """Run the warm start (the module docstring) on models from `new_model(init_seed)` with the tokenizer `tok`;
    returns (the trained model, what was measured). At most 4 threads: matrices this small gain nothing from more."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, 4))
    try:
        return _warm_start(new_model, tok, template, spec, seed, log)
    finally:
        torch.set_num_threads(threads)


def _warm_start(new_model, tok, template: str, spec: dict, seed: int, log) -> tuple[object, dict]:
    import torch

    t0 = time.time()
    heldout = arithmetic_rows(f"{seed}:heldout")
    skip = {next(heldout)["prompt"] for _ in range(spec["exclude_heldout"])}
    source = (row for row in arithmetic_rows(f"tiny-calc:{seed}") if row["prompt"] not in skip)
    rows = [next(source) for _ in range(spec["chats"] + spec["probe_chats"])]
    rows, probe_rows = rows[: spec["chats"]], rows[spec["chats"] :]
    rng = random.Random(f"tiny-calc-mix:{seed}")
    share = spec["calib_tool_share"]
    mix = [chat(r["prompt"], r["answer"], call_tool=rng.random() < share[_op(r["prompt"])]) for r in rows]
    format_data = _encode(tok, [chat(r["prompt"], r["answer"], call_tool=True) for r in rows], template)
    probe_data = _encode(tok, [chat(r["prompt"], r["answer"], call_tool=True) for r in probe_rows], template)
    digits = {tok.convert_tokens_to_ids(str(d)) for d in range(10)}
    result_start = tok.convert_tokens_to_ids("</tool_response>")
    warmup = spec["warmup"]
    best, probes, attempts = None, [], 0
    for attempt in range(spec["attempts"]):
        attempts += 1
        init = attempt
        model = new_model(init)
        batches = _Batches(format_data, spec["batch"], torch.Generator().manual_seed(init))
        probe = _Batches(probe_data, len(probe_data), None)
        state = {"formed": False, "score": (0.0, 0.0)}

        def stop(step, attempt=attempt, model=model, probe=probe, state=state):
            if step % spec["probe_every"]:
                return False
            state["score"] = score = _probe(model, probe, digits, result_start)
            probes.append([attempt, step, *score])
            if log:
                log(f"warm start: attempt {attempt} step {step}: expression {score[0]:.2f} answer {score[1]:.2f}")
            state["formed"] |= score[0] >= spec["formed"]
            if score[0] >= spec["target"][0] and score[1] >= spec["target"][1]:
                return True
            return not state["formed"] and step >= spec["attempt_steps"]

        steps = _train(model, batches, spec["max_steps"], spec["lr"], lambda s: min(1.0, (s + 1) / warmup), stop)
        if best is None or sum(state["score"]) > sum(best[0]):
            best = (state["score"], model, attempt, steps)
        if state["formed"]:
            break
    score, model, attempt, steps = best
    t_format = time.time() - t0
    mix_batches = _Batches(_encode(tok, mix, template), spec["batch"], torch.Generator().manual_seed(seed))
    calib = spec["calib_steps"]
    _train(model, mix_batches, calib, spec["calib_lr"], lambda s: 1 - s / max(calib, 1))
    stats = {
        "attempts": attempts,
        "kept_attempt": attempt,
        "format_steps": steps,
        "probe_after_format": list(score),
        "probe_after_calibration": list(
            _probe(model, _Batches(probe_data, len(probe_data), None), digits, result_start)
        ),
        "probes": probes,
        "seconds_format": round(t_format, 1),
        "seconds": round(time.time() - t0, 1),
    }
    return model, stats


def _op(question: str) -> str:
    return next(op for op in "+-*" if f" {op} " in question)
