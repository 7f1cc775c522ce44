#!/usr/bin/python3
"""The dt GPT in PyTorch (nanoGPT semantics: pre-LN blocks, tanh GELU, tied LM head, biases),
timed on random tokens with the same AdamW and gradient clipping, for side-by-side comparison.

    torch_gpt.py --layers 4 --heads 4 --embd 256 --seq 128 --vocab 256 --batch 16 --steps 20
prints one line: "torch tok/s <value>".

On a GPU: --device cuda --dtype bf16 runs the products under bf16 autocast (fp32 master weights,
as dt's train.dtype=bf16), with attention written out as above (--attention plain, the algorithm
dt's kernels run) or through F.scaled_dot_product_attention (--attention sdpa, flash attention);
--micro splits each batch into micro-batches of that many sequences, as dt's train.micro-batch.
"""
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, c, nh, sdpa=False):
        super().__init__()
        self.nh = nh
        self.sdpa = sdpa
        self.ln_1 = nn.LayerNorm(c)
        self.c_attn = nn.Linear(c, 3 * c)
        self.c_proj = nn.Linear(c, c)
        self.ln_2 = nn.LayerNorm(c)
        self.c_fc = nn.Linear(c, 4 * c)
        self.mlp_proj = nn.Linear(4 * c, c)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        hs = C // self.nh
        q = q.view(B, T, self.nh, hs).transpose(1, 2)
        k = k.view(B, T, self.nh, hs).transpose(1, 2)
        v = v.view(B, T, self.nh, hs).transpose(1, 2)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, seq, layers, heads, embd, sdpa=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, embd)
        self.wpe = nn.Embedding(seq, embd)
        self.h = nn.ModuleList([Block(embd, heads, sdpa) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(embd)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.h:
            x = b(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    p = argparse.ArgumentParser()
    for k, d in [("layers", 4), ("heads", 4), ("embd", 256), ("seq", 128), ("vocab", 256),
                 ("batch", 16), ("micro", 0), ("steps", 20), ("warmup", 3), ("threads", 1)]:
        p.add_argument("--" + k, type=int, default=d)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--attention", choices=["plain", "sdpa"], default="plain")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    dev = torch.device(a.device)
    micro = a.micro or a.batch
    if a.batch % micro:
        p.error("--batch %d is not a multiple of --micro %d" % (a.batch, micro))
    m = GPT(a.vocab, a.seq, a.layers, a.heads, a.embd, a.attention == "sdpa").to(dev)
    decay = [q for q in m.parameters() if q.dim() >= 2]
    other = [q for q in m.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": other, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95))
    x = torch.randint(0, a.vocab, (a.batch, a.seq), device=dev)
    y = torch.randint(0, a.vocab, (a.batch, a.seq), device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            sync()
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for j in range(0, a.batch, micro):
            with torch.autocast(dev.type, torch.bfloat16, enabled=a.dtype == "bf16"):
                loss = m(x[j:j + micro], y[j:j + micro]) * (micro / a.batch)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
    sync()
    dt = time.perf_counter() - t0
    print("torch tok/s %.1f" % (a.batch * a.seq * a.steps / dt))


if __name__ == "__main__":
    main()
