"""The Batch API: POST/GET /v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel.

A batch runs the request lines of an uploaded file (purpose "batch") against
one endpoint (/v1/chat/completions, /v1/completions, /v1/embeddings) in the
background, at a lower priority than interactive requests; its results land
in an output file and an error file (batch/runner.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field

from baton_openai.batch.store import BatchRecord, Status
from baton_openai.endpoints.files import MAX_LIST, page, runner_of
from baton_openai.http.openapi import error_responses
from baton_openai.protocol.openai import STRICT

router = APIRouter()
#: Metadata pairs a batch may carry, and their lengths (OpenAI's bounds).
MAX_METADATA = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


class CreateBatchRequest(BaseModel):
    model_config = STRICT
    input_file_id: str = Field(max_length=64)
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
    completion_window: Literal["24h"] = "24h"
    metadata: (
        Annotated[
            dict[
                Annotated[str, Field(max_length=MAX_METADATA_KEY)],
                Annotated[str, Field(max_length=MAX_METADATA_VALUE)],
            ],
            Field(max_length=MAX_METADATA),
        ]
        | None
    ) = None


class RequestCountsModel(BaseModel):
    total: int
    completed: int
    failed: int


class BatchErrorModel(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrorsModel(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorModel]


class BatchModel(BaseModel):
    """OpenAI's batch object."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    input_file_id: str
    completion_window: str
    status: Status
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: BatchErrorsModel | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCountsModel
    metadata: dict[str, str] | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchModel]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


def batch_model(rec: BatchRecord) -> BatchModel:
    return BatchModel.model_validate(rec.api_view())


@router.post("/v1/batches", responses=error_responses(400, 401, 404, 408, 413, 503))
async def create_batch(req: CreateBatchRequest, raw: Request) -> BatchModel:
    rec = await runner_of(raw).create(
        req.input_file_id, req.endpoint, req.completion_window, req.metadata
    )
    return batch_model(rec)


@router.get("/v1/batches", responses=error_responses(400, 401, 503))
async def list_batches(
    raw: Request,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = 20,
) -> BatchList:
    return BatchList(**page([batch_model(r) for r in runner_of(raw).list()], after, limit))


@router.get("/v1/batches/{batch_id}", responses=error_responses(401, 404, 503))
async def retrieve_batch(batch_id: str, raw: Request) -> BatchModel:
    return batch_model(runner_of(raw).get(batch_id))


@router.post("/v1/batches/{batch_id}/cancel", responses=error_responses(400, 401, 404, 503))
async def cancel_batch(batch_id: str, raw: Request) -> BatchModel:
    return batch_model(await runner_of(raw).cancel(batch_id))
