-- register(workers; token, name, ttl_ms, min_wid) -> {'fenced'} | {'ok', wid, previous_wid or 0}
--
-- Every registration is a new incarnation with a fresh id: the previous incarnation's
-- entries are stale (its process restarted), so it is retired, not reused. The id is above
-- min_wid, the highest id the caller has seen: a Redis Cluster failover may lose the latest
-- INCR of next_wid while other slots still hold entries under the ids it gave out.

local token = tonumber(ARGV[1])
local name = ARGV[2]
if not fence_ok(token) then
  return {'fenced'}
end
local previous = tonumber(redis.call('HGET', WORKERS, name)) or 0
if previous ~= 0 then
  retire(previous, name)
end
local wid = redis.call('INCR', gkey('next_wid'))
local min_wid = tonumber(ARGV[4]) or 0
if wid <= min_wid then
  wid = min_wid + 1
  redis.call('SET', gkey('next_wid'), wid)
end
if wid > 16777215 then
  return redis.error_reply('worker ids exhausted (24-bit); purge the directory')
end
redis.call('HSET', WORKERS, name, wid)
redis.call('HSET', gkey('wname'), wid, name)
redis.call('SET', gkey('lease:' .. wid), 1, 'PX', ARGV[3])
return {'ok', wid, previous}
