"""The built-in inference engine: a Hugging Face causal LM served over SGLang's HTTP API subset.

``inflight engine --model DIR --port N`` runs ``stages.engine.server``. The pieces:
``protocol`` (parse and validate ``/generate`` bodies, batches and ``n`` > 1 groups, render
SGLang-shaped results), ``sampling`` (temperature / top-k / top-p / min-p, the reported
log-probs and finish tests, batched over slots), ``kv_batch`` (the preallocated slot KV cache
that rows join and leave), ``prefix_cache`` (finished requests' KV in a bounded radix tree, so a
next turn prefills only its new tokens), ``scheduler`` (continuous batching, shared prefills for
identical prompts, weight updates between two decode steps), ``model_weights`` (load named
tensors in place), ``loader`` (model + tokenizer from a directory). ``bench/engine_profile.py``
measures a decode step against the model's own forward, ``bench/multiturn.py`` the prefix cache
on multi-turn episodes. It does not stream and has no tensor parallelism.
"""
