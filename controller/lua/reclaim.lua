-- reclaim(meta; token, budget) -> {'fenced'} | {'ok', num_deleted, num_pending_epochs}
--
-- Deletes at most about `budget` items of old epochs (pages first, by HSCAN with a cursor
-- kept in the meta hash, then the per-worker index sets by SPOP), oldest epoch first.
-- Nothing writes an old epoch, so a cursor stays valid across calls.

local token = tonumber(ARGV[1])
local budget = tonumber(ARGV[2])
if not fence_ok(token) then
  return {'fenced'}
end
local epoch = current_epoch()
local lo = tonumber(redis.call('HGET', META, 'reclaim_lo')) or epoch
local deleted = 0
local step = 500  -- keeps unpack() far below Lua's C-stack limit

while lo < epoch and budget > 0 do
  local pages = nskey('p:' .. lo)
  local holders = nskey('ws:' .. lo)
  if redis.call('EXISTS', pages) == 1 then
    local cursor = redis.call('HGET', META, 'reclaim_cursor') or '0'
    local reply = redis.call('HSCAN', pages, cursor, 'COUNT', math.min(budget, step))
    local fields = {}
    local kv = reply[2]
    for j = 1, #kv, 2 do
      fields[#fields + 1] = kv[j]
    end
    for j = 1, #fields, step do
      redis.call('HDEL', pages, unpack(fields, j, math.min(j + step - 1, #fields)))
    end
    deleted = deleted + #fields
    budget = budget - math.max(#fields, 1)
    if reply[1] == '0' then
      redis.call('DEL', pages)
      redis.call('HDEL', META, 'reclaim_cursor')
    else
      redis.call('HSET', META, 'reclaim_cursor', reply[1])
    end
  else
    local w = redis.call('SRANDMEMBER', holders)
    if w then
      local index = nskey('w:' .. lo .. ':' .. w)
      local popped = redis.call('SPOP', index, math.min(budget, step))
      deleted = deleted + #popped
      budget = budget - math.max(#popped, 1)
      if redis.call('EXISTS', index) == 0 then
        redis.call('SREM', holders, w)
      end
    else
      redis.call('DEL', holders, nskey('c:' .. lo))
      lo = lo + 1
      redis.call('HSET', META, 'reclaim_lo', lo)
    end
  end
end
return {'ok', deleted, epoch - lo}
