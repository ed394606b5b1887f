-- Helpers shared by the worker-registry scripts; directory.py prepends this file to each one.
--
-- KEYS[1] is "kvt:{g}:workers" (hash: worker name -> id of its current incarnation). All
-- controller-wide keys share the {g} hash tag with the leader lease, so these scripts are
-- single-slot and can compare a fencing token with the leader epoch directly.

local WORKERS = KEYS[1]
local G = string.sub(WORKERS, 1, -8)

local function gkey(suffix)
  return G .. suffix
end

local function fence_ok(token)
  return token >= (tonumber(redis.call('GET', gkey('leader_epoch'))) or 0)
end

-- The incarnation stops being live at once and waits in `retired` until its entries are purged.
local function retire(wid, name)
  redis.call('DEL', gkey('lease:' .. wid))
  redis.call('SADD', gkey('retired'), wid)
  if name and redis.call('HGET', WORKERS, name) == tostring(wid) then
    redis.call('HDEL', WORKERS, name)
  end
end
