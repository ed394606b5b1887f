-- sweep(workers; token) -> {'fenced'} | {'ok', wid_1, wid_2, ...}
--
-- Retires every incarnation whose lease key has expired and returns all retired ids (newly
-- and previously retired) whose entries still need purging. O(number of incarnations).

if not fence_ok(tonumber(ARGV[1])) then
  return {'fenced'}
end
local retired = gkey('retired')
local names = redis.call('HGETALL', gkey('wname'))
for j = 1, #names, 2 do
  local wid = names[j]
  if redis.call('EXISTS', gkey('lease:' .. wid)) == 0 and redis.call('SISMEMBER', retired, wid) == 0 then
    retire(tonumber(wid), names[j + 1])
  end
end
local out = {'ok'}
for _, wid in ipairs(redis.call('SMEMBERS', retired)) do
  out[#out + 1] = tonumber(wid)
end
return out
