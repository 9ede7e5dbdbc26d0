"""One request's way through a producer and a consumer (vLLM's disaggregated-serving flow).

The proxy sends the client's request to a producer with ``max_tokens = 1``, no streaming and
``kv_transfer_params = {"do_remote_decode": true}``: the producer computes the prompt and saves
its KV. The producer's response carries the ``kv_transfer_params`` that say where that KV lies;
the proxy sends the client's original request with them to a consumer, which loads the KV
instead of computing it, decodes, and answers the client (streamed or not) through the proxy.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx

from baton_openai.http.errors import OpenAIError

#: The request fields that stand for the answer's length (chat has both names).
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens")
#: Request fields about the answer, not the prompt: the producer's one token needs none.
_DECODE_ONLY = ("stream", "stream_options", "n", "min_tokens")
#: Client headers passed on to both engines.
FORWARDED_HEADERS = ("authorization", "x-request-id")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The producer's request: the prompt computed, one token sampled, the KV saved."""
    if "kv_transfer_params" in body:
        raise OpenAIError(
            "kv_transfer_params is the proxy's to set: leave it out of requests to pd-proxy",
            param="kv_transfer_params",
            code="invalid_value",
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
        raise OpenAIError(
            "pd-proxy hands one prompt's KV to the decoder: send one prompt per request",
            param="prompt",
            code="invalid_value",
        )
    out = {k: v for k, v in body.items() if k not in _DECODE_ONLY}
    for name in LENGTH_FIELDS:
        out.pop(name, None)
    out["max_tokens"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


class Upstreams:
    """The producer and consumer engines, each taken round-robin."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], timeout: float) -> None:
        self.prefill_urls = [u.rstrip("/") for u in prefill]
        self.decode_urls = [u.rstrip("/") for u in decode]
        self._next_prefill = itertools.cycle(self.prefill_urls)
        self._next_decode = itertools.cycle(self.decode_urls)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0))

    async def aclose(self) -> None:
        await self.client.aclose()

    async def prefill_params(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any]:
        """Run the prefill on a producer; the ``kv_transfer_params`` its response carries."""
        url = next(self._next_prefill) + path
        try:
            resp = await self.client.post(url, json=prefill_body(body), headers=headers)
        except httpx.HTTPError as e:
            raise OpenAIError(f"the producer {url} did not answer: {e}", status=502) from None
        if resp.status_code != 200:
            raise UpstreamError(resp)
        params = resp.json().get("kv_transfer_params")
        if not isinstance(params, dict):
            raise OpenAIError(
                f"the producer {url} returned no kv_transfer_params: start it with "
                '[kv_transfer] connector = "pd" and role = "producer"',
                status=502,
            )
        return params

    async def decode(
        self, path: str, body: dict[str, Any], params: dict[str, Any], headers: dict[str, str]
    ) -> httpx.Response:
        """Send the request with the producer's params to a consumer; the open response
        (its body not read yet: the caller streams it and closes it)."""
        url = next(self._next_decode) + path
        request = self.client.build_request(
            "POST", url, json={**body, "kv_transfer_params": params}, headers=headers
        )
        try:
            return await self.client.send(request, stream=True)
        except httpx.HTTPError as e:
            raise OpenAIError(f"the consumer {url} did not answer: {e}", status=502) from None


class UpstreamError(Exception):
    """An engine refused the request: its status and body go back to the client as they are."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(response.status_code)
        self.status = response.status_code
        self.content = response.content


async def relay(response: httpx.Response) -> AsyncIterator[bytes]:
    """The consumer's body as it comes; the response is closed at the end (or on disconnect)."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    finally:
        await response.aclose()


def forwarded(headers: Any) -> dict[str, str]:
    return {k: headers[k] for k in FORWARDED_HEADERS if k in headers}


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise OpenAIError(f"the body is not JSON: {e}", code="invalid_value") from None
    if not isinstance(body, dict):
        raise OpenAIError("the body must be a JSON object", code="invalid_value")
    return body
