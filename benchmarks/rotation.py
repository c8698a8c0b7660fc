"""Offline rotation of a Llama model before 4-bit GPTQ (QuaRot / SpinQuant's R1 and R2, issue 38).

A few input channels of the default model's linears carry most of the activations' and weights'
magnitude (outliers), and a 4-bit grid with one scale per 64 weights spends its levels on them.
Multiplying the residual stream by an orthogonal matrix spreads every channel over all of them
(a random Hadamard matrix does it best: each output channel is a +-1/sqrt(n) mix of all inputs),
so the weights GPTQ rounds have no outliers left, while the model computes the same function:

* R1, ``q`` (hidden x hidden) on the residual stream. Each RMSNorm's weight is first folded into
  the linears that read its output (q/k/v after ``input_layernorm``, gate/up after
  ``post_attention_layernorm``, ``lm_head`` after the final norm) and set to one; an RMSNorm
  without a weight commutes with ``q`` (it preserves the norm). Then every linear that reads the
  stream becomes ``W q`` (q, k, v, gate, up, lm_head), every one that writes to it ``q^T W``
  (o_proj, down_proj), and the embedding rows ``E q``.
* R2, one orthogonal ``r`` (head_dim x head_dim) per KV head on v_proj's output rows
  (``r^T W_v``) and o_proj's input columns of every query head that reads that KV head
  (``W_o r``): attention mixes value vectors across positions, never across their channels.

Nothing is left to do at run time, so the quantized result is still a plain W4A16 checkpoint. The
final norm folded into ``lm_head`` unties it from the embedding: the rotated model is written
untied (``tie_word_embeddings: false``), its ``lm_head`` kept unquantized. Q and K are not rotated
(R3/R4 of SpinQuant need an online transform, after RoPE and before down_proj).

Hadamard matrices are built here, not read from a table: Sylvester's doubling times a Paley
matrix (order q + 1 for a prime q = 3 mod 4, 2(q + 1) for q = 1 mod 4; 576 = 16 * 36, 36 from
q = 17); with no such factorisation, a random orthogonal matrix (QR of a Gaussian) is used.
"""

from __future__ import annotations

import torch


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))


def _paley(n: int) -> torch.Tensor | None:
    """A Hadamard matrix of order ``n`` by Paley's constructions I or II, or None."""
    if n in (1, 2):
        return torch.tensor([[1.0]]) if n == 1 else torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    for q, kind in ((n - 1, 1), (n // 2 - 1, 2)):
        if kind == 2 and n % 2:
            continue
        if not _is_prime(q) or q % 4 != (3 if kind == 1 else 1):
            continue
        squares = {(i * i) % q for i in range(1, q)}
        chi = [0] + [1 if i in squares else -1 for i in range(1, q)]
        jac = torch.tensor([[chi[(j - i) % q] for j in range(q)] for i in range(q)], dtype=float)
        c = torch.zeros(q + 1, q + 1, dtype=torch.float64)  # the conference matrix
        c[0, 1:], c[1:, 0], c[1:, 1:] = 1.0, 1.0 if kind == 2 else -1.0, jac
        if kind == 1:  # c is skew: I + c is Hadamard
            return torch.eye(q + 1, dtype=torch.float64) + c
        a = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)  # for c's zeros
        b = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)  # for its +-1
        return torch.kron(torch.eye(q + 1, dtype=torch.float64), a) + torch.kron(c, b)
    return None


def hadamard(n: int) -> torch.Tensor | None:
    """A Hadamard matrix of order ``n`` (entries +-1, H H^T = n I), float64, or None."""
    power = 1
    while n % (2 * power) == 0:
        power *= 2
    for sylvester in range(power.bit_length() - 1, -1, -1):  # the largest 2^k first
        base = _paley(n >> sylvester)
        if base is not None:
            h = base.to(torch.float64)
            two = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
            for _ in range(sylvester):
                h = torch.kron(h, two)
            return h
    return None


def random_orthogonal(n: int, generator: torch.Generator, kind: str = "hadamard") -> torch.Tensor:
    """A random orthogonal ``n`` x ``n`` matrix (float64): a Hadamard matrix with random column
    signs, scaled by 1/sqrt(n) (``kind="hadamard"``, where one of that order is built), else the Q
    of a Gaussian matrix's QR (signs fixed by R's diagonal)."""
    if kind == "hadamard":
        h = hadamard(n)
        if h is not None:
            signs = torch.randint(0, 2, (n,), generator=generator).to(torch.float64) * 2 - 1
            return h * signs / n**0.5
    q, r = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


@torch.no_grad()
def rotate_llama(model: torch.nn.Module, seed: int = 0, kind: str = "hadamard") -> None:
    """Rotates a transformers Llama causal LM in place (R1 and R2, see the module docstring);
    its logits are unchanged up to rounding. The result is untied, with unit norm weights."""
    cfg = model.config
    inner = model.model
    gen = torch.Generator().manual_seed(seed)
    hidden, head_dim = cfg.hidden_size, getattr(cfg, "head_dim", None)
    head_dim = head_dim or hidden // cfg.num_attention_heads
    kv_heads = cfg.num_key_value_heads
    per_kv = cfg.num_attention_heads // kv_heads
    r1 = random_orthogonal(hidden, gen, kind)

    def update(linear: torch.nn.Linear, weight: torch.Tensor) -> None:
        assert linear.bias is None, "biases are not rotated"
        linear.weight.data = weight.to(linear.weight.dtype).contiguous()

    def reads(linears, norm) -> None:  # W <- (W diag(norm)) r1, the norm's weight set to 1
        scale = norm.weight.to(torch.float64)
        for linear in linears:
            update(linear, (linear.weight.to(torch.float64) * scale) @ r1)
        norm.weight.data.fill_(1.0)

    def writes(linear) -> None:  # W <- r1^T W
        update(linear, r1.t() @ linear.weight.to(torch.float64))

    embed = inner.embed_tokens.weight
    if model.lm_head.weight is embed or cfg.tie_word_embeddings:
        model.lm_head.weight = torch.nn.Parameter(embed.detach().clone())
        cfg.tie_word_embeddings = False
        if hasattr(model, "_tied_weights_keys"):
            model._tied_weights_keys = {} if isinstance(model._tied_weights_keys, dict) else []
    embed.data = (embed.to(torch.float64) @ r1).to(embed.dtype)
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        reads((attn.q_proj, attn.k_proj, attn.v_proj), layer.input_layernorm)
        reads((mlp.gate_proj, mlp.up_proj), layer.post_attention_layernorm)
        writes(mlp.down_proj)
        v = attn.v_proj.weight.to(torch.float64).view(kv_heads, head_dim, hidden)
        o = attn.o_proj.weight.to(torch.float64).view(hidden, kv_heads, per_kv, head_dim)
        r2 = torch.stack([random_orthogonal(head_dim, gen, kind) for _ in range(kv_heads)])
        v = torch.einsum("kde,kdi->kei", r2, v)  # r2^T W_v, per KV head
        o = torch.einsum("okpd,kde->okpe", o, r2)  # W_o r2, per query head of that KV head
        update(attn.v_proj, v.reshape(kv_heads * head_dim, hidden))
        update(attn.o_proj, o.reshape(hidden, -1))
        writes(attn.o_proj)
    reads((model.lm_head,), inner.norm)


def save_rotated(base, out, seed: int = 0, kind: str = "hadamard"):
    """Writes ``base`` (a Llama checkpoint directory) rotated, in float32 and untied, with its
    tokenizer files, into ``out``; returns ``out``. Done once: an existing ``out`` is kept."""
    import shutil
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    base, out = Path(base), Path(out)
    if (out / "config.json").exists():
        return out
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    rotate_llama(model, seed, kind)
    model.save_pretrained(out)
    for extra in base.iterdir():
        if extra.is_file() and extra.name.startswith(("tokenizer", "special_tokens", "vocab")):
            shutil.copy(extra, out / extra.name)
        elif extra.name in ("merges.txt", "generation_config.json", "chat_template.jinja"):
            shutil.copy(extra, out / extra.name)
    return out
