"""Schemathesis against the served OpenAPI spec: whatever a client sends, valid by the spec or not, kiln
answers 2xx-4xx (or a queue-full 503), never a server error, and streams never break off."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.conftest import TEST_HOME
from tests.serving import kiln_server

pytestmark = pytest.mark.slow

MODEL = "smollm2:135m"
GENERATION = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/api/chat", "/api/generate", "/api/show",
              "/v1/embeddings", "/api/embed", "/api/embeddings", "/v1/messages", "/v1/messages/count_tokens",
              "/tokenize", "/detokenize", "/apply-template", "/infill"}
EXAMPLES = 15  # per operation and mode: about two minutes in all on two cores


def aim_at_the_model(case) -> None:
    """Random model names only reach the not-found path, so half the generation requests name the real
    model: the fuzzed fields then go through templating, tokenizing and decoding, kept short."""
    body = case.body
    if case.operation.path not in GENERATION or not isinstance(body, dict) or len(repr(body)) % 2:
        return
    body["model"] = MODEL
    body.pop("keep_alive", None)  # 0 would unload the model for the next case
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict"):
        if isinstance(body.get(key), int) and body[key] > 8:
            body[key] = 8
    if isinstance(body.get("options"), dict):
        body["options"]["num_predict"] = 8
        body["options"].pop("num_ctx", None)  # each new one would reload the model


def test_no_server_errors(smollm2_path):
    # A small context bounds every generation the fuzzer triggers.
    with kiln_server(TEST_HOME, MODEL, "--parallel", "2", "--ctx-len", "96", "--max-queue", "4") as server:
        schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
        seen = []
        for result in schema.get_all_operations():
            operation = result.ok()
            modes = [schemathesis.GenerationMode.POSITIVE]
            # only JSON bodies can be made invalid (a blob upload's bytes are whatever they are)
            if operation.method.upper() in ("POST", "DELETE") and any(b.media_type == "application/json" for b in operation.body):
                modes.append(schemathesis.GenerationMode.NEGATIVE)
            for mode in modes:
                @given(case=operation.as_strategy(generation_mode=mode))
                @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                          suppress_health_check=list(HealthCheck))
                def check(case):
                    aim_at_the_model(case)
                    response = case.call(base_url=server.url, timeout=120)
                    seen.append(response.status_code)
                    busy = response.status_code in (503, 529) and "queue" in response.text  # 529: Anthropic's word
                    assert response.status_code < 500 or busy, \
                        f"{case.method} {case.operation.path} -> {response.status_code}: {response.text[:500]}"
                    assert "Traceback" not in response.text

                check()
        assert len(seen) > 100 and any(200 <= s < 300 for s in seen) and any(400 <= s < 500 for s in seen)
