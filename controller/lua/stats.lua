#!lua flags=no-writes
-- stats(meta) -> {epoch, reclaim_lo, fence, counters (flat hash), meta (flat hash)}

local epoch = current_epoch()
local lo = tonumber(redis.call('HGET', META, 'reclaim_lo')) or epoch
local fence = tonumber(redis.call('HGET', META, 'fence')) or 0
return {epoch, lo, fence, redis.call('HGETALL', nskey('c:' .. epoch)), redis.call('HGETALL', META)}
