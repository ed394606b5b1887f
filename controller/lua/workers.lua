#!lua flags=no-writes
-- workers(workers) -> {wid_1, name_1, lease_pttl_ms_1, ...} for every incarnation not yet purged
-- (retired ones included); pttl is -2 when the lease key is gone (expired or retired).

local names = redis.call('HGETALL', gkey('wname'))
local out = {}
for j = 1, #names, 2 do
  local wid = names[j]
  out[#out + 1] = tonumber(wid)
  out[#out + 1] = names[j + 1]
  out[#out + 1] = redis.call('PTTL', gkey('lease:' .. wid))
end
return out
