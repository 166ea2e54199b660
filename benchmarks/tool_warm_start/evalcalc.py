"""Greedy held-out evaluation with TRL's own parser and the tool loop (2 iterations), as GRPOTrainer runs it."""

from __future__ import annotations

import re

import torch
from trl.chat_template_utils import add_response_schema, parse_response

from colocate_rl import builtin_model as bm
from colocate_rl.prompts import heldout_builtin_rows

NUM = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text):
    m = NUM.findall(text or "")
    return m[-1] if m else None


def episode_stats(completion, answer):
    """completion: list of messages (assistant / tool). -> (correct, called, well_formed)"""
    last_asst = [m for m in completion if m["role"] == "assistant"]
    text = last_asst[-1].get("content", "") if last_asst else ""
    correct = last_number(text) == str(answer)
    tool_msgs = [m for m in completion if m["role"] == "tool"]
    called = len(tool_msgs) > 0
    ok = called and not any(str(m["content"]).startswith("{'error'") for m in tool_msgs)
    return correct, called, ok


def run_tool(call, tools):
    f = call["function"]
    try:
        return str(tools[f["name"]](**f["arguments"]))
    except Exception as e:  # as TRL: an error dict
        return str({"error": str(e)})


@torch.no_grad()
def generate(model, tok, ids_list, max_new):
    pad = tok.pad_token_id
    L = max(len(x) for x in ids_list)
    x = torch.tensor([[pad] * (L - len(i)) + i for i in ids_list])
    att = torch.tensor([[0] * (L - len(i)) + [1] * len(i) for i in ids_list])
    out = model.generate(input_ids=x, attention_mask=att, max_new_tokens=max_new, do_sample=False, pad_token_id=pad)
    res = []
    for row in out[:, L:].tolist():
        if tok.eos_token_id in row:
            row = row[: row.index(tok.eos_token_id) + 1]
        else:
            row = [t for t in row if t != pad]
        res.append(row)
    return res


def evaluate(model_dir, n=64, seed=123, max_completion=64, iterations=2, model=None, tok=None, show=0):
    from calc import calculator
    from transformers import AutoModelForCausalLM

    tok = tok or bm.load_tokenizer(model_dir)
    if getattr(tok, "response_template", None) is None:
        add_response_schema(tok)
    model = model or AutoModelForCausalLM.from_pretrained(model_dir)
    was_training = model.training
    model.eval()
    rows = heldout_builtin_rows("arithmetic", n, seed)
    tools = {"calculator": calculator}
    convs = [[{"role": "user", "content": r["prompt"]}] for r in rows]
    prompt_ids = [
        tok.apply_chat_template(c, tools=[calculator], add_generation_prompt=True, tokenize=True, return_dict=False)
        for c in convs
    ]
    comp_ids = generate(model, tok, prompt_ids, max_completion)
    completions = [[parse_response(tok, ids, prefix=p, tools=[calculator])] for ids, p in zip(comp_ids, prompt_ids)]
    active = [i for i in range(n) if completions[i][0].get("tool_calls")]
    it = 0
    full = [p + c for p, c in zip(prompt_ids, comp_ids)]
    while active and it < iterations:
        nxt = []
        for i in active:
            msgs = completions[i]
            calls = msgs[-1]["tool_calls"]
            for call in calls:
                msgs.append({"role": "tool", "name": call["function"]["name"], "content": run_tool(call, tools)})
        # re-render (prefix preserving) to get prompt + completion + tool suffix
        ctx = []
        for i in active:
            ids = tok.apply_chat_template(
                convs[i] + completions[i],
                tools=[calculator],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            ctx.append(ids)
        outs = generate(model, tok, ctx, max_completion)
        for i, c, o in zip(active, ctx, outs):
            full[i] = c + o
            m = parse_response(tok, o, prefix=c, tools=[calculator])
            completions[i].append(m)
            if m.get("tool_calls"):
                nxt.append(i)
        active = nxt
        it += 1
    stats = [episode_stats(c, r["answer"]) for c, r in zip(completions, rows)]
    acc = sum(s[0] for s in stats) / n
    call = sum(s[1] for s in stats) / n
    ok = sum(s[2] for s in stats) / n
    acc_call = sum(s[0] for s in stats if s[1]) / max(1, sum(s[1] for s in stats))
    acc_direct = sum(s[0] for s in stats if not s[1]) / max(1, sum(not s[1] for s in stats))
    for i in range(show):
        print("   ", rows[i]["prompt"], "->", repr(tok.decode(full[i][len(prompt_ids[i]) :])))
    if was_training:
        model.train()
    return dict(acc=acc, call=call, well_formed=ok, acc_call=acc_call, acc_direct=acc_direct)
