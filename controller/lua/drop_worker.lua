-- drop_worker(meta; token, wid, budget) -> {'fenced'} | {'ok', num_removed, num_remaining}
--
-- Removes up to `budget` of the worker's records in the current epoch, using the worker's
-- index set, so the cost is bounded per call and proportional to what the worker held.
-- Older epochs are left to reclaim.lua. Once the index is empty the worker's sequence number
-- is forgotten too (a retired worker id is never reused).

local token = tonumber(ARGV[1])
local wid = tonumber(ARGV[2])
local budget = tonumber(ARGV[3])
if not fence_ok(token) then
  return {'fenced'}
end
local b = new_batch(current_epoch(), wid)
local removed = 0
for _, key in ipairs(redis.call('SRANDMEMBER', b.index, budget)) do
  local node = load_node(b, key)
  local rec = node and node.recs[wid]
  if rec then
    if rec[1] ~= 0 then
      removed = removed + 1
    end
    set_mask(b, key, node, 0, true)
  else
    index_member(b, key, false)
  end
end
flush(b)
local remaining = redis.call('SCARD', b.index)
if remaining == 0 then
  redis.call('SREM', nskey('ws:' .. b.epoch), wid)
  redis.call('HDEL', nskey('s'), wid)
end
return {'ok', removed, remaining}
