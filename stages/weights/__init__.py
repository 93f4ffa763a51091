"""Weight publishing: the learner broadcasts weight buckets to inference engines (SGLang's API).

``group`` makes the weight process group as SGLang does, ``buckets`` packs SGLang's
``flattened_bucket`` layout, ``receiver`` is the engine side and ``publisher`` the learner side.
"""
