-- Write-side helpers: fencing, page-value decoding, and a batch that keeps every counter
-- exact. Prepended after namespace_keys.lua to the scripts that write.

local NO_PARENT = string.rep('\0', 16)

-- Fencing ratchet: a token below the highest one this namespace has seen is refused; a higher
-- one raises the namespace's fence so the previous leader's tokens are refused from now on.
local function fence_ok(token)
  local fence = tonumber(redis.call('HGET', META, 'fence')) or 0
  if token < fence then
    return false
  end
  if token > fence then
    redis.call('HSET', META, 'fence', token)
  end
  return true
end

-- Little-endian u24 as 3 bytes.
local function p24(x)
  return string.char(x % 256, math.floor(x / 256) % 256, math.floor(x / 65536))
end

-- Node = decoded page value: {parent = 16 bytes, recs = {[wid] = {mask, nH, nD, nN}}}.
local function decode(v)
  local recs = {}
  for p = 17, #v, REC do
    recs[u24(v, p)] = {string.byte(v, p + 3), u24(v, p + 4), u24(v, p + 7), u24(v, p + 10)}
  end
  return {parent = string.sub(v, 1, 16), recs = recs}
end

-- One 13-byte holder record (layout in namespace_keys.lua), built in one call.
local function record(w, r)
  local floor = math.floor
  local c1, c2, c3 = r[2], r[3], r[4]
  return string.char(w % 256, floor(w / 256) % 256, floor(w / 65536), r[1],
                     c1 % 256, floor(c1 / 256) % 256, floor(c1 / 65536),
                     c2 % 256, floor(c2 / 256) % 256, floor(c2 / 65536),
                     c3 % 256, floor(c3 / 256) % 256, floor(c3 / 65536))
end

local function encode(node)
  local recs = node.recs
  local w, r = next(recs)
  if w == nil then
    return nil
  end
  if next(recs, w) == nil then  -- one holder: the common case, without sorting
    return node.parent .. record(w, r)
  end
  local wids = {}
  for wid in pairs(recs) do
    wids[#wids + 1] = wid
  end
  table.sort(wids)
  local parts = {node.parent}
  for _, wid in ipairs(wids) do
    parts[#parts + 1] = record(wid, recs[wid])
  end
  return table.concat(parts)
end

-- Fields per multi-argument command (HMGET, HSET, SADD, SREM): well under the Lua C stack
-- limit that unpack() hits near 8000 values.
local CHUNK = 1000

-- A write batch: decoded nodes cached by key, written back once by flush(). Page values and
-- the worker's index set are only read before flush() writes them, so reading values ahead
-- (preload) and deferring index changes to flush (members: key -> present) leave every result
-- as if each call had gone to Redis in event order, at a few calls per batch instead of three
-- per event.
local function new_batch(epoch, wid)
  return {
    epoch = epoch, wid = wid, pages = nskey('p:' .. epoch), index = nskey('w:' .. epoch .. ':' .. wid),
    nodes = {}, raw = {}, dirty = {}, members = {}, tiers = {0, 0, 0}, entries = 0, pages_held = 0,
    orphans = 0, inversions = 0, indexed = false, unindexed = false,
  }
end

-- Reads the page values of `keys` (a list, duplicates allowed) in a few HMGETs.
local function preload(b, keys)
  local want, seen = {}, {}
  for _, key in ipairs(keys) do
    if b.nodes[key] == nil and b.raw[key] == nil and not seen[key] then
      seen[key] = true
      want[#want + 1] = key
    end
  end
  for first = 1, #want, CHUNK do
    local last = math.min(first + CHUNK - 1, #want)
    local got = redis.call('HMGET', b.pages, unpack(want, first, last))
    for j = first, last do
      b.raw[want[j]] = got[j - first + 1]  -- false when absent
    end
  end
end

local function load_node(b, key)
  local node = b.nodes[key]
  if node == nil then
    local v = b.raw[key]
    if v == nil then
      v = redis.call('HGET', b.pages, key)
    end
    node = v and decode(v) or false
    b.nodes[key] = node
  end
  return node or nil
end

-- Records that `key` is (present) or is not in the worker's index set; flush() writes it.
local function index_member(b, key, present)
  b.members[key] = present
  if present then
    b.indexed = true
  else
    b.unindexed = true
  end
end

-- Runs `command key fields...` over `fields` in chunks (`step` values per field).
local function call_chunked(command, key, fields, step)
  local per = CHUNK * step
  for first = 1, #fields, per do
    redis.call(command, key, unpack(fields, first, math.min(first + per - 1, #fields)))
  end
end

-- Tier mask -> {1 if a copy is in tier t else 0, for t = 1..3}.
local IN_TIER = {[0] = {0, 0, 0}, {1, 0, 0}, {0, 1, 0}, {1, 1, 0}, {0, 0, 1}, {1, 0, 1}, {0, 1, 1}, {1, 1, 1}}

-- What a record's held children add to (inversions, orphans) while the record's fastest tier
-- is `f`: children in a faster tier are inversions; with no copy (f = 0) all are orphans.
local function child_terms(rec, f)
  if f == 0 then
    return 0, rec[2] + rec[3] + rec[4]
  end
  return (f >= 2 and rec[2] or 0) + (f >= 3 and rec[3] or 0), 0
end

-- Sets the batch worker's tier mask on `key` (node must exist) and keeps every counter exact.
-- With `purge`, the record is deleted even if it still has children (they become orphans).
local function set_mask(b, key, node, new_mask, purge)
  local wid = b.wid
  local rec = node.recs[wid]
  if not rec then
    rec = {0, 0, 0, 0}
    node.recs[wid] = rec
    index_member(b, key, true)
  end
  local old_mask = rec[1]
  local f_old, f_new = FASTEST[old_mask], FASTEST[new_mask]
  rec[1] = new_mask
  b.dirty[key] = true
  if old_mask ~= new_mask then
    local was, now, tiers = IN_TIER[old_mask], IN_TIER[new_mask], b.tiers
    for t = 1, 3 do
      tiers[t] = tiers[t] + now[t] - was[t]
    end
  end
  if f_old ~= f_new then
    if f_old == 0 or f_new == 0 then
      local delta = (f_old == 0) and 1 or -1
      b.entries = b.entries + delta
      local others = false
      for w, r in pairs(node.recs) do
        if w ~= wid and r[1] ~= 0 then
          others = true
          break
        end
      end
      if not others then
        b.pages_held = b.pages_held + delta
      end
    end
    -- The edge to the parent (depth > 1).
    if node.parent ~= NO_PARENT then
      local pnode = load_node(b, node.parent)
      local prec = pnode and pnode.recs[wid]
      local pf = prec and FASTEST[prec[1]] or 0
      if f_old ~= 0 then
        if prec then
          prec[f_old + 1] = prec[f_old + 1] - 1
        end
        if pf == 0 then
          b.orphans = b.orphans - 1
        elseif f_old < pf then
          b.inversions = b.inversions - 1
        end
      end
      if f_new ~= 0 then
        if prec then
          prec[f_new + 1] = prec[f_new + 1] + 1
        end
        if pf == 0 then
          b.orphans = b.orphans + 1
        elseif f_new < pf then
          b.inversions = b.inversions + 1
        end
      end
      if prec then
        b.dirty[node.parent] = true
        if prec[1] == 0 and prec[2] + prec[3] + prec[4] == 0 then
          pnode.recs[wid] = nil  -- a ghost whose last child left
          index_member(b, node.parent, false)
        end
      end
    end
    -- The edges to this page's own held children.
    local inv_old, orph_old = child_terms(rec, f_old)
    local inv_new, orph_new = child_terms(rec, f_new)
    b.inversions = b.inversions + inv_new - inv_old
    b.orphans = b.orphans + orph_new - orph_old
  end
  -- A purged record's children stay counted as orphans until they are removed themselves.
  if new_mask == 0 and (purge or rec[2] + rec[3] + rec[4] == 0) then
    node.recs[wid] = nil
    index_member(b, key, false)
  end
end

local function flush(b)
  local added, removed = {}, {}
  for key, present in pairs(b.members) do
    local list = present and added or removed
    list[#list + 1] = key
  end
  call_chunked('SADD', b.index, added, 1)
  call_chunked('SREM', b.index, removed, 1)
  local set, gone = {}, {}
  for key in pairs(b.dirty) do
    local v = encode(b.nodes[key])
    if v then
      set[#set + 1] = key
      set[#set + 1] = v
    else
      gone[#gone + 1] = key
    end
  end
  call_chunked('HSET', b.pages, set, 2)
  call_chunked('HDEL', b.pages, gone, 1)
  local counts = nskey('c:' .. b.epoch)
  for t = 1, 3 do
    if b.tiers[t] ~= 0 then
      redis.call('HINCRBY', counts, t, b.tiers[t])
    end
  end
  for field, delta in pairs({entries = b.entries, pages = b.pages_held}) do
    if delta ~= 0 then
      redis.call('HINCRBY', counts, field, delta)
    end
  end
  for field, delta in pairs({orphans = b.orphans, inversions = b.inversions}) do
    if delta ~= 0 then
      redis.call('HINCRBY', META, field, delta)
    end
  end
  if b.entries ~= 0 then
    redis.call('HINCRBY', counts, 'w:' .. b.wid, b.entries)
  end
  local holders = nskey('ws:' .. b.epoch)
  if b.indexed then
    redis.call('SADD', holders, b.wid)
  end
  if b.unindexed and redis.call('EXISTS', b.index) == 0 then
    redis.call('SREM', holders, b.wid)
    redis.call('HDEL', counts, 'w:' .. b.wid)
  end
end
