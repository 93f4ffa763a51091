"""The built-in inference engine: a Hugging Face causal LM served over SGLang's HTTP API.

``inflight engine --model DIR --port N`` runs ``stages.engine.server``. The pieces:

- requests: ``protocol`` (parse and validate ``/generate`` bodies, batches and ``n`` > 1
  groups, render SGLang-shaped results), ``stop_regex``, ``prompt_logprobs`` (input log-probs
  and prefill-only scoring), ``incremental_text`` (text as SGLang's detokenizer makes it),
  ``aborts`` (how an aborted request ends);
- sampling: ``sampling`` (temperature / top-k / top-p / min-p, the reported log-probs and
  finish tests, batched over slots), ``penalties`` (SGLang's penalizers and logit bias),
  ``grammar`` (``json_schema``, ``regex``, ``ebnf``, ``structural_tag`` through llguidance),
  ``structural_format`` and ``qwen_xml`` (structural tags in xgrammar's newer ``format``
  form, written for llguidance);
- running: ``scheduler`` (continuous batching, shared prefills for identical prompts, weight
  updates between two decode steps), ``kv_batch`` (the preallocated slot KV cache that rows
  join and leave), ``prefix_cache`` (finished requests' KV in a bounded radix tree, so a next
  turn prefills only its new tokens), ``llama_forward`` (the fast forward pass),
  ``model_weights`` (load named tensors in place), ``loader`` (model + tokenizer from a
  directory), ``lora_adapters``;
- serving: ``server`` (the native routes), ``streaming`` and ``chunk_stream`` (``stream:
  true``), ``openai_api`` and ``openai_chat`` (``/v1``), ``template_dump`` (a chat request's
  messages and tools as the template sees them at SGLang), ``tool_calls`` (reading and forcing
  tool calls), ``native_tags`` (the models' own call tags SGLang forces calls with),
  ``lora_routes``, ``auth``, ``identity``, ``in_process`` (the engine inside
  another process).

``bench/engine_profile.py`` measures a decode step against the model's own forward and the
routes' cost, ``bench/multiturn.py`` the prefix cache on multi-turn episodes,
``bench/grammar.py`` constrained decoding, ``bench/engine_soak.py`` whether it survives every
kind of request at once while it pauses and reloads. No tensor parallelism.
"""
