-- forget(workers; token, wid) -> {'fenced'} | {'ok', 1 if forgotten, 0 if entries remain}
--
-- Drops the last trace of a retired incarnation once no namespace lists it any more.

if not fence_ok(tonumber(ARGV[1])) then
  return {'fenced'}
end
local wid = ARGV[2]
if redis.call('SCARD', gkey('wns:' .. wid)) > 0 then
  return {'ok', 0}
end
redis.call('HDEL', gkey('wname'), wid)
redis.call('SREM', gkey('retired'), wid)
return {'ok', 1}
