-- heartbeat(workers; token, name, wid, ttl_ms) -> {'fenced'} | {'ok'} | {'unknown'} | {'expired'}
--
-- Renews only a lease that still exists (SET XX): once a lease has expired, the incarnation
-- is retired and the worker must register again and resend its inventory, because lookups
-- may already have stopped seeing it and the sweeper may be purging its entries.

local token = tonumber(ARGV[1])
local name = ARGV[2]
local wid = ARGV[3]
if not fence_ok(token) then
  return {'fenced'}
end
if redis.call('HGET', WORKERS, name) ~= wid then
  return {'unknown'}
end
if not redis.call('SET', gkey('lease:' .. wid), 1, 'PX', ARGV[4], 'XX') then
  retire(tonumber(wid), name)
  return {'expired'}
end
return {'ok'}
