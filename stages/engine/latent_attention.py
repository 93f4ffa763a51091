"""Multi-head latent attention (DeepSeek-V2's and V3's, Moonlight's, Kimi K2's) on the engine's
own passes (``llama_forward``).

A layer keeps one latent per token instead of keys and values per head: ``c``, the normed first
``kv_lora_rank`` outputs of ``kv_a_proj_with_mqa``, and ``r``, its last ``qk_rope_head_dim``
outputs rotated, one key part shared by every head. The cache holds them as transformers' does:
``c`` as a layer's keys ``[rows, 1, L, kv_lora_rank]``, ``r`` as its values ``[rows, 1, L,
rope]``, so the slot cache, the prefix cache and transformers' passes read the same tensors.
``kv_b_proj`` expands a latent into each head's key part without rotation and its value.

- ``prefill`` expands the latents of the whole context (past and new) and attends as multi-head
  attention does (what SGLang does for a prefill): the expansion costs one matmul a position,
  where attending in the latent space would cost the latent's width a query and key pair.
- ``decode`` attends in the latent space instead, one query a row against its whole context:
  each head's query is taken through its key expansion (``q_nope W_uk``, a vector of the
  latent's width), scored against ``c`` directly and ``r`` for the rotated part, and the
  weighted sum of ``c`` is taken through the value expansion (``W_uv``) after the softmax, so no
  step expands the context (SGLang's absorbed decode). The same arithmetic, reassociated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["LatentAttention", "is_latent"]

# (x [..., rope], cos, sin) -> x rotated
Rotate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (scores, blocked, values, sinks) -> softmax(scores) @ values, as ``LlamaForward._attend``
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]
# (q, keys, values, blocked, sinks) -> each row attended over its own columns alone, as
# ``LlamaForward._attend_rows`` (deterministic passes)
AttendRows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]
# (x, weight, bias) -> x @ weight.T + bias: F.linear, or batch_invariant.linear
Linear = Callable[..., torch.Tensor]
# (x [n, heads, in], weight [heads, in, out]) -> [n, heads, out]: batch_invariant.batched
Batched = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def is_latent(attn: Any) -> bool:
    """Whether the attention module ``attn`` is multi-head latent attention (one whose
    ``kv_b_proj`` has a bias, which DeepSeek's has not, ``LlamaForward.unsupported`` refuses)."""
    return isinstance(getattr(attn, "kv_a_proj_with_mqa", None), torch.nn.Linear)


class LatentAttention:
    """One layer's latent attention, on the model's own tensors (``attn``: its module)."""

    def __init__(self, attn: Any, heads: int) -> None:
        self.heads = heads
        self.nope = attn.qk_nope_head_dim
        self.rope = attn.qk_rope_head_dim
        self.rank = attn.kv_lora_rank
        self.v = attn.v_head_dim
        # q from the hidden state: one projection, or down, norm, up (q_lora_rank)
        self.q = getattr(attn, "q_proj", None)
        self.q_a, self.q_b = getattr(attn, "q_a_proj", None), getattr(attn, "q_b_proj", None)
        norm = getattr(attn, "q_a_layernorm", None)
        self.q_a_norm = None if norm is None else norm.forward
        self.kv_a = attn.kv_a_proj_with_mqa
        self.kv_a_norm = attn.kv_a_layernorm.forward
        self.kv_b = attn.kv_b_proj

    def products(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Its products' (weight, bias), as its deterministic passes run them (the heads' key
        and value expansions as ``batched``'s weights)."""
        out = [(self.kv_a.weight, self.kv_a.bias), (self.kv_b.weight, None)]
        if self.q_a is None:
            out.append((self.q.weight, self.q.bias))
        else:
            out += [(self.q_a.weight, self.q_a.bias), (self.q_b.weight, self.q_b.bias)]
        expand = self._expansions()
        keys, values = expand[:, : self.nope], expand[:, self.nope :].transpose(1, 2)
        return [*out, (keys, None), (values, None)]

    def _expansions(self) -> torch.Tensor:
        """``kv_b_proj``'s weight by head: ``[heads, nope + v, rank]``."""
        return self.kv_b.weight.view(self.heads, self.nope + self.v, self.rank)

    def _inputs(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rotate: Rotate,
        linear: Linear = F.linear,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Of normed ``x`` ``[..., hidden]``: the queries' parts without and with rotation
        ``[..., heads, nope|rope]``, the latent ``c`` ``[..., rank]`` and the rotated shared key
        part ``r`` ``[..., 1, rope]``."""
        if self.q_a is None:
            q = linear(x, self.q.weight, self.q.bias)
        else:
            down = self.q_a_norm(linear(x, self.q_a.weight, self.q_a.bias))
            q = linear(down, self.q_b.weight, self.q_b.bias)
        q = q.view(*x.shape[:-1], self.heads, self.nope + self.rope)
        latent = linear(x, self.kv_a.weight, self.kv_a.bias)
        c = self.kv_a_norm(latent[..., : self.rank])
        r = latent[..., self.rank :].unsqueeze(-2)
        return q[..., : self.nope], rotate(q[..., self.nope :], cos, sin), c, rotate(r, cos, sin)

    def decode(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: Any,
        blocked: torch.Tensor,
        rotate: Rotate,
        attend: Attend,
        linear: Linear = F.linear,
        attend_rows: AttendRows | None = None,
        batched: Batched | None = None,
    ) -> torch.Tensor:
        """The attention's output ``[rows, heads * v]`` (before ``o_proj``) of one decode
        step: ``x`` ``[rows, hidden]`` normed, ``cos``/``sin`` ``[rows, 1, rope]``, ``cache``
        the layer's slot cache (its pending column written), ``blocked`` ``[rows, 1, 1, L]``.
        With ``attend_rows`` and ``batched`` (deterministic passes), its products go through
        ``linear``, the heads' expansions through ``batched``, and each row attends alone."""
        n, h = x.shape[0], self.heads
        q_nope, q_rot, c, r = self._inputs(x, cos, sin, rotate, linear)
        latents, shared = cache.update(c.view(n, 1, 1, -1), r.view(n, 1, 1, -1))  # [n, 1, L, *]
        expand = self._expansions()
        if attend_rows is not None and batched is not None:  # the same arithmetic, a row's
            # one query of h heads over one key (the latent and the rotated part) a column
            q_latent = batched(q_nope, expand[:, : self.nope])  # [n, h, rank]
            q = torch.cat((q_latent, q_rot), -1).view(n, 1, h, 1, -1)
            keys = torch.cat((latents, shared), -1)  # [n, 1, L, rank + rope]
            mixed = attend_rows(q, keys, latents, blocked.unsqueeze(-2), None).view(n, h, -1)
            out = batched(mixed, expand[:, self.nope :].transpose(1, 2))  # [n, h, v]
            return out.reshape(n, h * self.v)
        # each head's query through its key expansion: [h, n, nope] @ [h, nope, rank]
        q_latent = torch.bmm(q_nope.transpose(0, 1), expand[:, : self.nope]).transpose(0, 1)
        scores = torch.matmul(q_latent.unsqueeze(1), latents.transpose(-1, -2))  # [n, 1, h, L]
        scores = scores + torch.matmul(q_rot.unsqueeze(1), shared.transpose(-1, -2))
        mixed = attend(scores, blocked, latents, None)  # [n, 1, h, rank]
        # through each head's value expansion: [h, n, rank] @ [h, rank, v]
        out = torch.bmm(mixed[:, 0].transpose(0, 1), expand[:, self.nope :].transpose(1, 2))
        return out.transpose(0, 1).reshape(n, h * self.v)

    def prefill(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
        blocked: torch.Tensor,
        rotate: Rotate,
        attend: Attend,
        linear: Linear = F.linear,
        attend_rows: AttendRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the attention's output ``[rows, width, heads * v]``, the layer's latents ``c``
        ``[rows, 1, P + width, rank]`` and ``r`` ``[rows, 1, P + width, rope]`` to cache) of
        normed ``x`` ``[rows, width, hidden]`` after ``past`` (the cached latents of ``P``
        positions), ``cos``/``sin`` ``[rows, width, 1, rope]``, ``blocked`` ``[rows, 1, 1,
        width, P + width]``; ``linear`` and ``attend_rows`` as ``decode``'s."""
        rows, width, h = x.shape[0], x.shape[1], self.heads
        q_nope, q_rot, c, r = self._inputs(x, cos, sin, rotate, linear)
        latents, shared = c.unsqueeze(1), r.transpose(1, 2)  # [rows, 1, width, *]
        if past is not None:
            latents = torch.cat((past[0], latents), 2)
            shared = torch.cat((past[1], shared), 2)
        kv = linear(latents[:, 0], self.kv_b.weight)  # [rows, L, h * (nope + v)]
        kv = kv.view(rows, -1, h, self.nope + self.v).transpose(1, 2)  # [rows, h, L, nope+v]
        keys = torch.cat((kv[..., : self.nope], shared.expand(-1, h, -1, -1)), -1)
        q = torch.cat((q_nope, q_rot), -1).transpose(1, 2)  # [rows, h, width, nope+rope]
        if attend_rows is not None:
            out = attend_rows(q.unsqueeze(2), keys, kv[..., self.nope :], blocked, None)
        else:
            scores = torch.matmul(q.unsqueeze(2), keys.unsqueeze(2).transpose(-1, -2))
            out = attend(scores, blocked, kv[..., self.nope :].unsqueeze(2), None)
        out = out[:, :, 0].transpose(1, 2).reshape(rows, width, h * self.v)
        return out, latents, shared
