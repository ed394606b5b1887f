"""The only package that turns protobuf messages into domain records and back, one module per
service area (``common``, ``router``, ``worker``, ``sessions``, ``link_events``, ``link_commands``, ``admin``,
``policy``), on top of ``limits`` (wire limits) and ``fields`` (field readers).

Naming: ``to_proto_<record>(record) -> message`` and ``from_proto_<record>(message) ->
record``, one pair per record in ``kvtier.domain.records`` (plus ``NamespaceIdentity`` and
``SamplingParams``). Response messages that only wrap one record or a list of records
have their own pair named after the response (``to_proto_pause_response(info)``), so
servicers never build messages themselves.

``from_proto_*`` is where untrusted bytes become trusted records, so it validates:

- required fields (identity fields, ids, oneofs, sub-messages) and enums that are
  unset or carry an unknown number → ``InvalidArgument``;
- values out of range (negative token ids, keys that are not 16 bytes, non-finite
  floats, priorities, list limits) → ``InvalidArgument``;
- data-volume limits (prompt and prefix tokens, page-event batches, page lists of
  commands and snapshot chunks) → ``ResourceExhausted``: the sender must split the
  payload or the request can never fit.

Every error names the offending field by its path from the message being converted
(``namespace.model_id``, ``sampling.top_p``, ``events[3].page_key``). ``to_proto_*``
trusts its input: records are built by our own code. The wire never carries the
namespace policy epoch (server state), so ``to_proto_namespace_identity`` drops it and
``from_proto_namespace_identity`` returns epoch 0 for the server to resolve.
"""
