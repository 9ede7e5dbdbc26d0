"""The Files API (what a batch reads and writes): POST/GET /v1/files, GET/DELETE /v1/files/{id},
GET /v1/files/{id}/content. Uploads are multipart (``file``, ``purpose`` "batch"), at most
``server.max_file_bytes`` (a 413 past it), stored under ``server.files_dir``."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal, Protocol, TypeVar

import msgspec
from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse
from pydantic import BaseModel

from baton_openai.batch.file_store import FileObject, FileStore
from baton_openai.batch.runner import BatchRunner
from baton_openai.http.errors import OpenAIError
from baton_openai.http.openapi import error_responses

router = APIRouter()
#: Most files one list answers (OpenAI's bound).
MAX_LIST = 10_000


class FileModel(BaseModel):
    """OpenAI's file object."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileModel]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


def runner_of(raw: Request) -> BatchRunner:
    return raw.app.state.batches  # type: ignore[no-any-return]


def store_of(raw: Request) -> FileStore:
    return runner_of(raw).files


def file_model(obj: FileObject) -> FileModel:
    return FileModel(**msgspec.structs.asdict(obj))


@router.post("/v1/files", responses=error_responses(400, 401, 408, 413, 503))
async def upload_file(
    raw: Request,
    file: Annotated[UploadFile, File(description="The JSONL file")],
    purpose: Annotated[Literal["batch"], Form(description="What the file is for")],
) -> FileModel:
    store = store_of(raw)
    name = file.filename or "upload.jsonl"
    obj = await asyncio.to_thread(store.save, file.file, name, purpose)
    return file_model(obj)


@router.get("/v1/files", responses=error_responses(400, 401, 503))
async def list_files(
    raw: Request,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = MAX_LIST,
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> FileList:
    objs = await asyncio.to_thread(store_of(raw).list, purpose)
    if order == "asc":
        objs.reverse()
    return FileList(**page([file_model(o) for o in objs], after, limit))


class _HasId(Protocol):
    id: str


T = TypeVar("T", bound=_HasId)


def page(items: list[T], after: str | None, limit: int) -> dict[str, Any]:
    """A cursor page of ``items``: those after the one whose id is ``after``, at most ``limit``."""
    if after is not None:
        ids = [i.id for i in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    data = items[:limit]
    return {
        "data": data,
        "first_id": data[0].id if data else None,
        "last_id": data[-1].id if data else None,
        "has_more": len(items) > limit,
    }


@router.get("/v1/files/{file_id}", responses=error_responses(401, 404, 503))
async def retrieve_file(file_id: str, raw: Request) -> FileModel:
    return file_model(await asyncio.to_thread(store_of(raw).get, file_id))


@router.delete("/v1/files/{file_id}", responses=error_responses(400, 401, 404, 503))
async def delete_file(file_id: str, raw: Request) -> FileDeleted:
    if runner_of(raw).in_use(file_id):
        raise OpenAIError(
            f"file {file_id} is the input of a batch in progress: cancel the batch or wait for it",
            param="file_id",
            code="file_in_use",
        )
    obj = await asyncio.to_thread(store_of(raw).delete, file_id)
    return FileDeleted(id=obj.id)


@router.get(
    "/v1/files/{file_id}/content",
    response_class=FileResponse,
    responses={
        200: {"description": "The file's bytes", "content": {"application/octet-stream": {}}}
    }
    | error_responses(401, 404, 503),
)
async def file_content(file_id: str, raw: Request) -> FileResponse:
    store = store_of(raw)
    obj = await asyncio.to_thread(store.get, file_id)
    return FileResponse(
        store.data_path(file_id), media_type="application/octet-stream", filename=obj.filename
    )
