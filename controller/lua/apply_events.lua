-- apply_events(meta; token, wid, seq, events, root_key) -> outcome
--
--   {'fenced'} | {'duplicate', last_seq} | {'regressed', last_seq}
--   | {'ok', last_seq, num_applied, index_1, reason_1, index_2, reason_2, ...}   (0-based indexes)
--
-- Idempotent per (namespace, worker): a batch whose seq is not above the last applied one
-- changes nothing. Events apply in order; a malformed event is skipped with a reason and the
-- rest of the batch still applies. Event records are 40 bytes (see directory.py::_EVENT):
--   kind u8 | tier u8 | from_tier u8 | flags u8 | depth i32 | key 16 | parent 16
-- flags: 1 = has parent, 2 = a key or the parent is not 16 bytes.

local token = tonumber(ARGV[1])
local wid = tonumber(ARGV[2])
local seq = tonumber(ARGV[3])
local blob = ARGV[4]
local root = ARGV[5]

if not fence_ok(token) then
  return {'fenced'}
end
local seqs = nskey('s')
local last = tonumber(redis.call('HGET', seqs, wid)) or -1
if seq <= last then
  local kind = (seq == last) and 'duplicate' or 'regressed'
  redis.call('HINCRBY', META, kind, 1)
  return {kind, last}
end
redis.call('HSET', seqs, wid, seq)

local b = new_batch(current_epoch(), wid)
local out = {'ok', seq, 0}
local applied = 0
local reasons = {}

local function reject(i, reason)
  out[#out + 1] = i - 1
  out[#out + 1] = reason
  reasons[reason] = (reasons[reason] or 0) + 1
end

local function held_mask(node)
  local rec = node and node.recs[wid]
  return rec and rec[1] or 0
end

local n = #blob / 40
-- One pass reads every event's fields and lists every page value the loop can read (each
-- event's key and an insert's parent), which preload fetches in a few calls.
local keys, parents, wanted = {}, {}, {}
for i = 1, n do
  local o = (i - 1) * 40
  local kind, _, _, flags = string.byte(blob, o + 1, o + 4)
  if bit.band(flags, 2) == 0 then
    local key = string.sub(blob, o + 9, o + 24)
    keys[i] = key
    wanted[#wanted + 1] = key
    if kind == 1 and bit.band(flags, 1) ~= 0 then
      local parent = string.sub(blob, o + 25, o + 40)
      parents[i] = parent
      if parent ~= root then
        wanted[#wanted + 1] = parent
      end
    end
  end
end
preload(b, wanted)

for i = 1, n do
  local o = (i - 1) * 40
  local kind, tier, from, flags, d0, d1, d2, d3 = string.byte(blob, o + 1, o + 8)
  local depth = d0 + 256 * d1 + 65536 * d2 + 16777216 * d3
  if depth >= 2147483648 then
    depth = depth - 4294967296  -- i32, two's complement
  end
  local key = keys[i]
  if bit.band(flags, 2) ~= 0 then
    reject(i, 'bad_key')
  elseif kind == 1 then
    local parent = parents[i] or NO_PARENT
    if depth == 1 and parent == root then
      parent = NO_PARENT
    end
    local node = load_node(b, key)
    if node and next(node.recs) == nil then
      node = nil  -- its last record left earlier in this batch: the page no longer exists
    end
    if tier < 1 or tier > 3 then
      reject(i, 'bad_tier')
    elseif depth < 1 then
      reject(i, 'bad_depth')
    elseif (depth == 1 and parent ~= NO_PARENT) or (node and node.parent ~= parent) then
      reject(i, 'bad_parent')  -- a depth-1 page hangs off the root; a page has one parent
    elseif depth > 1 and (parent == NO_PARENT or held_mask(load_node(b, parent)) == 0) then
      reject(i, 'missing_parent')
    else
      if not node then
        node = {parent = parent, recs = {}}
        b.nodes[key] = node
      end
      local mask = held_mask(node)
      local new_mask = bit.bor(mask, bit.lshift(1, tier - 1))
      if new_mask ~= mask then
        set_mask(b, key, node, new_mask, false)
      end
      applied = applied + 1
    end
  elseif kind == 2 or kind == 3 then
    local node = load_node(b, key)
    local mask = held_mask(node)
    if (kind == 2 and (tier < 1 or tier > 3)) or from > 3 or (kind == 3 and tier > 3) then
      reject(i, 'bad_tier')
    elseif mask == 0 then
      reject(i, 'not_held')
    else
      local new_mask
      if kind == 2 then
        -- MOVE: now in `tier`; gone from `from` (or from every other tier when from is 0).
        local keep = (from == 0) and 0 or bit.band(mask, bit.bnot(bit.lshift(1, from - 1)))
        new_mask = bit.bor(keep, bit.lshift(1, tier - 1))
      else
        -- DROP: gone from `tier`, or from every tier when tier is 0.
        new_mask = (tier == 0) and 0 or bit.band(mask, bit.bnot(bit.lshift(1, tier - 1)))
      end
      if new_mask ~= mask then
        set_mask(b, key, node, new_mask, false)
      end
      applied = applied + 1
    end
  else
    reject(i, 'bad_kind')
  end
end

flush(b)
for reason, count in pairs(reasons) do
  redis.call('HINCRBY', META, 'rej:' .. reason, count)
end
out[3] = applied
return out
