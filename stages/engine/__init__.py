"""The built-in inference engine: a Hugging Face causal LM served over SGLang's HTTP API subset.

``inflight engine --model DIR --port N`` runs ``stages.engine.server``. The pieces:
``protocol`` (parse and validate ``/generate`` bodies, render SGLang-shaped results),
``sampling`` (temperature / top-k / top-p / min-p and the reported log-probs), ``kv_batch``
(the left-padded batched KV cache that rows join and leave), ``scheduler`` (continuous batching
and weight updates between two decode steps), ``model_weights`` (load named tensors in place),
``loader`` (model + tokenizer from a directory). It does not stream, has no prefix cache and no
tensor parallelism.
"""
