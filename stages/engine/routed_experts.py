"""The experts each token was routed to, as SGLang 0.5.23 returns them
(``--enable-return-routed-experts``, a request's ``return_routed_experts``): what RL on a
mixture-of-experts model needs to replay the sampler's routing in the learner (rollout routing
replay, as slime and verl run it), so that the learner's log-probs are those of the experts
that drew the tokens.

Capture. transformers (5.x) runs every mixture-of-experts family (Qwen2/3-MoE, Mixtral,
gpt-oss, OLMoE, DeepSeek V2/V3, GLM-4.5 ...) through an ``experts`` module called as
``experts(hidden_states [tokens, hidden], top_k_index [tokens, k], top_k_weights)``. A forward
pre-hook on each decoder layer's takes ``top_k_index``: the experts the tokens were run with,
however the router chose them (a softmax's top k, DeepSeek's grouped top k with its bias ...),
as SGLang's capturer takes its top-k ids inside the layer. Dense layers (Qwen3-MoE's
``mlp_only_layers``, DeepSeek's first layers) route nothing and read 0, as SGLang's zeroed
buffer leaves them.

Answer. ``meta_info.routed_experts`` of a finished sample: base64 of the little-endian int32
array ``[seqlen - 1 - start, layers, k]`` (``numpy().tobytes()``, SGLang's detokenizer's
encoding), ``seqlen`` the prompt's and the output's tokens together: every token the model
ran, from the request's ``routed_experts_start_len`` (0: all) on. The last output token never
went through the model and has no row.
"""

from __future__ import annotations

import base64
import inspect
from typing import Any

import torch

__all__ = [
    "ExpertsCapture",
    "decoder_layers",
    "encode_routes",
    "experts_module",
    "start_error",
    "top_k_name",
]


class ExpertsCapture:
    """Pre-hooks on a model's experts modules that keep, while armed, the ``top_k_index`` of
    each layer's last call; ``take`` gathers a pass's into ``[tokens, layers, k]``."""

    def __init__(self, model: Any) -> None:
        config = getattr(model.config, "get_text_config", lambda: model.config)()
        k = getattr(config, "num_experts_per_tok", None)
        if not isinstance(k, int) or k < 1:
            raise ValueError(
                "--enable-return-routed-experts: the model routes no experts (its config has no "
                f"num_experts_per_tok; model_type {getattr(config, 'model_type', None)!r})"
            )
        layers = decoder_layers(model)
        self.k = k
        self.layers = len(layers)
        self.armed = False
        self._taken: list[torch.Tensor | None] = [None] * self.layers
        found = 0
        for i, layer in enumerate(layers):
            experts = experts_module(layer)
            if experts is not None:
                experts.register_forward_pre_hook(self._hook(i, experts), with_kwargs=True)
                found += 1
        if not found:
            raise ValueError(
                "--enable-return-routed-experts: no decoder layer of this model has an experts "
                "module called as experts(hidden_states, top_k_index, top_k_weights), which is "
                "how transformers runs a mixture-of-experts layer"
            )
        self.routed_layers = found

    def _hook(self, layer: int, module: torch.nn.Module) -> Any:
        name = top_k_name(module)

        def pre(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self.armed:
                self._taken[layer] = args[1] if len(args) > 1 else kwargs[name]

        return pre

    def arm(self) -> None:
        """Keep the ids of the passes from now on (until ``take``)."""
        self._taken = [None] * self.layers
        self.armed = True

    def take(self, tokens: int) -> torch.Tensor:
        """The ids of the last pass over ``tokens`` tokens (in the order the model flattened
        them: row by row), ``[tokens, layers, k]`` int32 on the CPU; stops keeping them."""
        self.armed = False
        taken, self._taken = self._taken, [None] * self.layers
        device = next((ids.device for ids in taken if ids is not None), torch.device("cpu"))
        out = torch.zeros((tokens, self.layers, self.k), dtype=torch.int32, device=device)
        for i, ids in enumerate(taken):
            if ids is not None:
                out[:, i] = ids.reshape(tokens, -1)[:, : self.k]
        return out.cpu()  # one copy off the device a pass

    @staticmethod
    def piece(rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (``[tokens, layers, k]``) as the prefix cache keeps them beside a node's KV,
        tokens on the second axis from the end as in its keys and values: ``[1, layers,
        tokens, k]`` (the cache slices and joins every piece on that axis)."""
        return rows.permute(1, 0, 2).unsqueeze(0)


def decoder_layers(model: Any, flag: str = "--enable-return-routed-experts") -> Any:
    """The model's decoder layers; ValueError naming ``flag`` (the server flag that needs
    them) for a model without."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(
            f"{flag}: the model has no decoder layers (model.layers) to capture the routing of"
        )
    return layers


def top_k_name(module: torch.nn.Module) -> str:
    """The name an experts module's ``forward`` takes its top-k ids by (its second
    parameter), for a hook that finds them among the keyword arguments."""
    return list(inspect.signature(module.forward).parameters)[1]


def experts_module(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The layer's module named ``experts`` that takes (hidden states, top-k ids, weights)."""
    for name, module in layer.named_modules():
        if name.rsplit(".", 1)[-1] != "experts":
            continue
        try:
            params = inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            continue
        if len(params) >= 3:
            return module
    return None


def encode_routes(rows: torch.Tensor) -> str:
    """``meta_info.routed_experts``: base64 of the int32 array's bytes, as SGLang writes it."""
    return base64.b64encode(rows.contiguous().numpy().tobytes()).decode("ascii")


def start_error(start: int, prompt_tokens: int) -> str | None:
    """SGLang's refusal of a ``routed_experts_start_len`` (``Scheduler.handle_generate_request``,
    its f-strings' words), None where it takes it."""
    if start > prompt_tokens:
        return (
            f"recv_req.routed_experts_start_len={start} is higher than the number of input "
            f"tokens len(req.origin_input_ids)={prompt_tokens}. Please use a smaller "
            "routed_experts_start_len."
        )
    if start < 0:
        return (
            f"recv_req.routed_experts_start_len={start} is lower than 0. Please use a "
            "non-negative routed_experts_start_len."
        )
    return None
