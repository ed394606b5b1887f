-- invalidate(meta; token) -> {'fenced'} | {'ok', new_epoch}
--
-- O(1): bumps the namespace epoch, so every key of the old epoch is unreachable at once
-- (all scripts derive key names from the current epoch). reclaim.lua deletes the old keys
-- later in bounded steps, starting at `reclaim_lo`, the oldest epoch not yet reclaimed.

local token = tonumber(ARGV[1])
if not fence_ok(token) then
  return {'fenced'}
end
local epoch = current_epoch()
if not redis.call('HGET', META, 'reclaim_lo') then
  redis.call('HSET', META, 'reclaim_lo', epoch)
end
redis.call('HSET', META, 'epoch', epoch + 1, 'orphans', 0, 'inversions', 0)  -- the new epoch is empty
return {'ok', epoch + 1}
