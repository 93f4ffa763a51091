"""Parsing SGLang-style /generate responses into completions, and the errors for bad ones."""

import numpy as np
import pytest

from stages.generator.client import EngineError, parse_completion


def _body(**meta):
    return {
        "output_ids": [5, 6, 7],
        "meta_info": {
            "id": "r1",
            "finish_reason": {"type": "length", "length": 3},
            "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 7, None]],
            "weight_version": "4",
            **meta,
        },
    }


def test_per_token_versions_are_used_when_reported():
    c = parse_completion(_body(output_token_weight_versions=[3, 3, 4]))
    assert c.output_ids.dtype == np.int32 and c.output_ids.tolist() == [5, 6, 7]
    assert np.allclose(c.logprobs, [-0.1, -0.2, -0.3]) and c.logprobs.dtype == np.float32
    assert c.versions.tolist() == [3, 3, 4]
    assert c.finish_reason == "length" and c.weight_version == 4


def test_engine_without_per_token_versions_gets_the_final_version_everywhere():
    c = parse_completion(_body())
    assert c.versions.tolist() == [4, 4, 4]


@pytest.mark.parametrize(
    "body",
    [
        {"output_ids": [1]},  # no meta_info
        {"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [[-0.1, 1, None]]}},
        {"output_ids": "x", "meta_info": {}},
    ],
)
def test_malformed_responses_are_final_errors(body):
    with pytest.raises(EngineError) as err:
        parse_completion(body, "http://e")
    assert not err.value.retryable and "http://e" in str(err.value)
