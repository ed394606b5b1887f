"""Wire limits: data volume (ResourceExhausted when exceeded), field shapes (InvalidArgument) and list defaults."""

from __future__ import annotations

# Data-volume limits (ResourceExhausted when exceeded).
MAX_PROMPT_TOKENS = 1 << 20  # prompt and prefix token ids per request
MAX_PREFIX_PAGE_KEYS = MAX_PROMPT_TOKENS // 16  # page keys per prefix (the default page size)
MAX_BATCH_EVENTS = 4096  # page events per PageEventBatch
MAX_COMMAND_PAGES = 65536  # page keys per Demote / Prefetch / Drop command
MAX_SNAPSHOT_CHUNK_PAGES = 16384  # pages per InventorySnapshotChunk
# Shape limits (InvalidArgument when exceeded).
MAX_PIN_REPLICAS = 16  # workers that keep a copy of a pinned prefix
MAX_ID_CHARS = 256  # worker, session, request, run, snapshot and pin ids; addresses
MAX_IDENTITY_FIELD_CHARS = 512  # each string field of a namespace / model identity
MAX_TEXT_CHARS = 4096  # reasons, error messages, tool names, problems
MAX_STOP_TOKEN_IDS = 1024
MAX_LIST_ITEMS = 4096  # adapters, tiers, workers, reports ... in one message
MAX_LIST_LIMIT = 1000  # `limit` of list RPCs
# Durations a caller gives (tool-call estimates, ETAs, pin TTLs): a year at most, so that
# "now + duration" always fits the uint64 timestamps sent back (and a typo is caught).
MAX_DURATION_MS = 365 * 24 * 3600 * 1000
# Servers and channels must raise grpc.max_receive_message_length / max_send_message_length
# to this (gRPC's default of 4 MiB is below a MAX_PROMPT_TOKENS prompt: up to 5 bytes a token).
MAX_MESSAGE_BYTES = 16 << 20
DEFAULT_LIST_SESSIONS_LIMIT = 100
DEFAULT_POLICY_HISTORY_LIMIT = 20
TICKET_KEY_BYTES = 32
"""Length of a worker's Route-ticket key (HMAC-SHA256; ``kvtier.rpc.tickets``)."""
