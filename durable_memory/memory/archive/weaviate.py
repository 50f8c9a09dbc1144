"""Archival memory on Weaviate (weaviate-client v4): one multi-tenant collection, tenant = user.

Vectors are self-provided (our Embedder), so both backends embed identically, and hybrid search
passes the query vector in with `relativeScoreFusion`, which the embedded store reproduces.
Written from the client's documentation and tested by the shared contract suite whenever
WEAVIATE_URL is set (no Weaviate server runs on our CI machines).
"""

import os
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlparse

import weaviate
from weaviate.classes.config import Configure, DataType, Property, Tokenization
from weaviate.classes.data import DataObject
from weaviate.classes.init import Auth
from weaviate.classes.query import Filter, HybridFusion, MetadataQuery, Sort
from weaviate.collections import Collection
from weaviate.exceptions import WeaviateBaseError

from durable_memory.memory.archive.embedders import Embedder
from durable_memory.memory.archive.protocol import (
    ArchiveError,
    check_passage,
    chunk_ids,
    embed_for_writing,
    missing_chunks,
)
from durable_memory.memory.core.ids import validate_user_id
from durable_memory.memory.store.recall import fts_terms
from durable_memory.models.archive import (
    ArchiveSearch,
    NewPassage,
    Passage,
    PassageHit,
    PassageSource,
    TagMatch,
)

DEFAULT_COLLECTION = "DurableMemoryPassage"
DELETE_BATCH = 1000
"""Ids per delete_many call, well under the server's QUERY_MAXIMUM_RESULTS (10,000)."""

_PROPERTIES = [
    Property(name="text", data_type=DataType.TEXT),
    Property(name="tags", data_type=DataType.TEXT_ARRAY, tokenization=Tokenization.FIELD),
    Property(name="created_at", data_type=DataType.DATE),
    Property(name="source", data_type=DataType.TEXT, tokenization=Tokenization.FIELD),
    Property(name="label", data_type=DataType.TEXT, tokenization=Tokenization.FIELD),
    Property(name="commit_sha", data_type=DataType.TEXT, tokenization=Tokenization.FIELD),
    Property(name="chunk", data_type=DataType.INT),
]


def connect(url: str | None = None, api_key: str | None = None) -> weaviate.WeaviateClient:
    """Connect to `url` (default WEAVIATE_URL), with WEAVIATE_API_KEY when set. gRPC is on the
    port in WEAVIATE_GRPC_PORT (default 50051) of the same host."""
    url = url or os.environ.get("WEAVIATE_URL")
    if not url:
        raise ArchiveError("no Weaviate URL: set WEAVIATE_URL (e.g. http://localhost:8080)")
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ArchiveError(f"WEAVIATE_URL {url!r} is not an http(s) URL")
    secure = parsed.scheme == "https"
    key = api_key or os.environ.get("WEAVIATE_API_KEY")
    return weaviate.connect_to_custom(
        http_host=parsed.hostname,
        http_port=parsed.port or (443 if secure else 80),
        http_secure=secure,
        grpc_host=parsed.hostname,
        grpc_port=int(os.environ.get("WEAVIATE_GRPC_PORT", "50051")),
        grpc_secure=secure,
        auth_credentials=Auth.api_key(key) if key else None,
    )


def _passage(user_id: str, obj: Any) -> Passage:
    props = obj.properties
    created = props["created_at"]
    return Passage(
        id=str(obj.uuid),
        user_id=user_id,
        text=props["text"],
        tags=tuple(props.get("tags") or ()),
        source=PassageSource(props["source"]),
        label=props.get("label") or None,
        commit_sha=props.get("commit_sha") or None,
        chunk=int(props.get("chunk") or 0),
        created_at=created if created.tzinfo else created.replace(tzinfo=UTC),
    )


class WeaviateArchive:
    """ArchiveStore on Weaviate."""

    def __init__(
        self,
        client: weaviate.WeaviateClient,
        embedder: Embedder,
        collection: str = DEFAULT_COLLECTION,
    ) -> None:
        self.client = client
        self.embedder = embedder
        self.name = collection
        marker = f"durable-memory passages; embedder={embedder.name}; dim={embedder.dim}"
        if not client.collections.exists(collection):
            client.collections.create(
                collection,
                description=marker,
                multi_tenancy_config=Configure.multi_tenancy(
                    enabled=True, auto_tenant_creation=True
                ),
                vector_config=Configure.Vectors.self_provided(),
                properties=_PROPERTIES,
            )
        existing = client.collections.use(collection).config.get().description or ""
        if existing != marker:
            raise ArchiveError(
                f"Weaviate collection {collection} was made for {existing!r}; this archive uses "
                f"{marker!r}. Use the same embedder or another collection"
            )

    def _tenant(self, user_id: str) -> Collection[Any, Any]:
        return self.client.collections.use(self.name).with_tenant(validate_user_id(user_id))

    def _has_tenant(self, user_id: str) -> bool:
        return self.client.collections.use(self.name).tenants.exists(validate_user_id(user_id))

    def insert(
        self,
        passage: NewPassage,
        *,
        chunk: bool = False,
        before_write: Callable[[], object] | None = None,
    ) -> list[str]:
        chunks = check_passage(passage, chunk=chunk)
        ids = chunk_ids(passage, chunks)
        tenant = self._tenant(passage.user_id)
        known: set[str] = set()
        if self._has_tenant(passage.user_id):
            found = tenant.query.fetch_objects(
                filters=Filter.by_id().contains_any(ids), limit=len(ids)
            )
            known = {str(o.uuid) for o in found.objects}
        todo = missing_chunks(ids, chunks, known)
        if not todo:
            return ids
        vectors = embed_for_writing(self.embedder, todo, before_write)
        created = passage.created_at or datetime.now(UTC)
        objects = [
            DataObject(
                uuid=pid,
                vector=vectors[n].tolist(),
                properties={
                    "text": text,
                    "tags": list(passage.tags),
                    "created_at": created,
                    "source": passage.source.value,
                    "label": passage.label or "",
                    "commit_sha": passage.commit_sha or "",
                    "chunk": index,
                },
            )
            for n, (index, pid, text) in enumerate(todo)
        ]
        result = tenant.data.insert_many(objects)
        failed = [e for e in result.errors.values() if "already exists" not in str(e.message)]
        if failed:
            raise ArchiveError(
                f"Weaviate refused {len(failed)} of {len(objects)} passages: {failed[0].message}"
            )
        return ids

    def _filters(self, request: ArchiveSearch) -> Any:
        parts: list[Any] = []
        if request.tags:
            tags = Filter.by_property("tags")
            parts.append(
                tags.contains_any(list(request.tags))
                if request.tag_match is TagMatch.ANY
                else tags.contains_all(list(request.tags))
            )
        if request.start is not None:
            parts.append(Filter.by_property("created_at").greater_or_equal(request.start))
        if request.end is not None:
            parts.append(Filter.by_property("created_at").less_than(request.end))
        return Filter.all_of(parts) if parts else None

    def search(self, user_id: str, request: ArchiveSearch) -> list[PassageHit]:
        terms = fts_terms(request.query)  # refuses an over-long query before any work
        if request.start and request.end and request.start >= request.end:
            raise ArchiveError("start must be before end")
        if not self._has_tenant(user_id):
            return []
        tenant = self._tenant(user_id)
        filters = self._filters(request)
        try:
            if not terms:
                result = tenant.query.fetch_objects(
                    filters=filters,
                    limit=request.top_k,
                    sort=Sort.by_property("created_at", ascending=False),
                )
                return [PassageHit(passage=_passage(user_id, o), score=0.0) for o in result.objects]
            result = tenant.query.hybrid(
                query=request.query,
                vector=self.embedder.embed_query(request.query).tolist(),
                alpha=request.alpha,
                fusion_type=HybridFusion.RELATIVE_SCORE,
                limit=request.top_k,
                filters=filters,
                return_metadata=MetadataQuery(score=True),
            )
        except WeaviateBaseError as error:
            raise ArchiveError(f"Weaviate search failed: {error}") from None
        return [
            PassageHit(passage=_passage(user_id, o), score=float(o.metadata.score or 0.0))
            for o in result.objects
        ]

    def count(self, user_id: str) -> int:
        if not self._has_tenant(user_id):
            return 0
        return int(self._tenant(user_id).aggregate.over_all(total_count=True).total_count or 0)

    def page(self, user_id: str, *, limit: int = 50, offset: int = 0) -> list[Passage]:
        if not 1 <= limit <= 1000 or offset < 0:
            raise ArchiveError("limit must be 1-1000 and offset not negative")
        if not self._has_tenant(user_id):
            return []
        result = self._tenant(user_id).query.fetch_objects(
            limit=limit, offset=offset, sort=Sort.by_property("created_at", ascending=False)
        )
        return [_passage(user_id, o) for o in result.objects]

    def delete(self, user_id: str, ids: list[str]) -> int:
        if not ids or not self._has_tenant(user_id):
            return 0
        tenant = self._tenant(user_id)
        deleted = 0
        for start in range(0, len(ids), DELETE_BATCH):
            part = ids[start : start + DELETE_BATCH]
            result = tenant.data.delete_many(where=Filter.by_id().contains_any(part))
            if result.failed:
                raise ArchiveError(f"Weaviate failed to delete {result.failed} passages")
            deleted += int(result.successful)
        return deleted

    def forget_user(self, user_id: str) -> int:
        """Remove the user's tenant: every object of theirs, and their shard's files."""
        if not self._has_tenant(user_id):
            return 0
        count = self.count(user_id)
        self.client.collections.use(self.name).tenants.remove([validate_user_id(user_id)])
        return count

    def close(self) -> None:
        self.client.close()
