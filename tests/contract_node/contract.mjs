// A kvtier frontend in Node, built from proto/ alone (plus the standard gRPC health,
// reflection and google.rpc protos in ./protos): no kvtier code, no checkpoint files.
// It drives a live stack and asserts the wire contract (DESIGN §7); tests/e2e/test_contract_node.py
// starts the stack and compares its greedy output with the Python client's.
//
//   KVTIER_CONTROLLER=host:port KVTIER_FRONTEND_TOKEN=... KVTIER_ADMIN_TOKEN=... node contract.mjs
//
// The last line of stdout is one JSON document: the namespace, prompt and greedy tokens used.
import assert from 'node:assert/strict';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import grpc from '@grpc/grpc-js';
import protoLoader from '@grpc/proto-loader';
import protobuf from 'protobufjs';

const here = path.dirname(fileURLToPath(import.meta.url));
const PROTO_ROOT = path.resolve(here, '../../proto');
const STD_ROOT = path.resolve(here, 'protos');
const DEADLINE_MS = 60_000;

const env = (name) => {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set`);
  return value;
};
const CONTROLLER = env('KVTIER_CONTROLLER');
const FRONTEND_TOKEN = env('KVTIER_FRONTEND_TOKEN');
const ADMIN_TOKEN = env('KVTIER_ADMIN_TOKEN');

const definition = protoLoader.loadSync(
  [
    'kvtier/v1/router.proto', 'kvtier/v1/worker.proto', 'kvtier/v1/sessions.proto', 'kvtier/v1/admin.proto',
    'grpc/health/v1/health.proto', 'grpc/reflection/v1alpha/reflection.proto',
  ],
  { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true, includeDirs: [PROTO_ROOT, STD_ROOT] },
);
const api = grpc.loadPackageDefinition(definition);
const kv = api.kvtier.v1;

// google.rpc.Status and its details, for grpc-status-details-bin.
const rpcRoot = new protobuf.Root();
rpcRoot.resolvePath = (_origin, target) => {
  const local = path.join(STD_ROOT, target);
  return target.startsWith('google/protobuf/') ? target : local;
};
rpcRoot.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto'], { keepCase: true });
const Status = rpcRoot.lookupType('google.rpc.Status');

const creds = grpc.credentials.createInsecure();
const bearer = (token) => {
  const md = new grpc.Metadata();
  if (token) md.set('authorization', `Bearer ${token}`);
  return md;
};
// Generate carries the Route ticket of its worker, never the bearer token.
const ticket = (routed) => {
  const md = new grpc.Metadata();
  if (routed.ticket) md.set('authorization', `Ticket ${routed.ticket}`);
  return md;
};
const options = () => ({ deadline: Date.now() + DEADLINE_MS });

function unary(client, method, request, token = FRONTEND_TOKEN) {
  return new Promise((resolve, reject) => {
    client[method](request, bearer(token), options(), (err, response) => (err ? reject(err) : resolve(response)));
  });
}

async function failure(promise) {
  try {
    await promise;
  } catch (err) {
    return err;
  }
  assert.fail('the call succeeded; an error was expected');
}

// The standard rich error details of a failed call, by message name.
function details(err) {
  const raw = err.metadata.get('grpc-status-details-bin');
  assert.equal(raw.length, 1, `no grpc-status-details-bin on ${err.code}: ${err.details}`);
  const status = Status.decode(raw[0]);
  assert.equal(status.code, err.code);
  assert.equal(status.message, err.details);
  const out = {};
  for (const any of status.details) {
    const name = any.type_url.split('/').pop();
    out[name.replace('google.rpc.', '')] = rpcRoot.lookupType(name).toObject(rpcRoot.lookupType(name).decode(any.value));
  }
  return out;
}

function expectError(err, code, field) {
  assert.equal(err.code, code, `expected ${code}, got ${err.code}: ${err.details}`);
  const d = details(err);
  assert.equal(d.ErrorInfo.domain, 'kvtier.dev');
  if (field !== undefined) {
    assert.deepEqual(d.BadRequest.field_violations.map((v) => v.field), [field]);
    assert.equal(err.metadata.get('kvtier-error-field')[0], field); // the trailer for older clients
  }
  return d;
}

function generate(routed, request) {
  const worker = new kv.Worker(routed.address, creds);
  return new Promise((resolve, reject) => {
    const tokens = [];
    let final = null;
    const call = worker.Generate(request, ticket(routed), options());
    call.on('data', (event) => {
      if (event.event === 'tokens') {
        assert.equal(event.tokens.index, tokens.length);
        tokens.push(...event.tokens.token_ids);
      } else {
        final = event.final;
      }
    });
    call.on('error', (err) => { worker.close(); reject(err); });
    call.on('end', () => { worker.close(); resolve({ tokens, final }); });
  });
}

async function health(address) {
  const client = new api.grpc.health.v1.Health(address, creds);
  const response = await unary(client, 'Check', { service: '' }, null);
  client.close();
  return response.status;
}

function listServices(address) {
  const client = new api.grpc.reflection.v1alpha.ServerReflection(address, creds);
  return new Promise((resolve, reject) => {
    const call = client.ServerReflectionInfo(new grpc.Metadata(), options());
    call.on('data', (response) => {
      call.end();
      client.close();
      resolve(response.list_services_response.service.map((s) => s.name));
    });
    call.on('error', reject);
    call.write({ list_services: '' });
  });
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function main() {
  const router = new kv.Router(CONTROLLER, creds);
  const sessions = new kv.Sessions(CONTROLLER, creds);
  const admin = new kv.Admin(CONTROLLER, creds);

  // Health and reflection answer without a token.
  assert.equal(await health(CONTROLLER), 'SERVING');
  const services = await listServices(CONTROLLER);
  for (const name of ['kvtier.v1.Router', 'kvtier.v1.Sessions', 'kvtier.v1.Admin']) assert.ok(services.includes(name), name);

  // ListModels: everything a frontend needs, from the wire alone.
  const { models } = await unary(router, 'ListModels', {});
  assert.equal(models.length, 1);
  const [model] = models;
  const { namespace, facts } = model;
  assert.equal(namespace.tenant, 'node'); // the frontend token's only tenant
  assert.ok(namespace.weights_digest.length > 0 && namespace.page_size > 0 && facts.vocab_size > 0);
  assert.ok(facts.max_context_tokens > 0 && facts.eos_token_ids.length > 0 && model.num_workers === 1);

  // A prompt of three full pages and two tokens, inside the vocabulary.
  const pageSize = namespace.page_size;
  const prompt = Array.from({ length: 3 * pageSize + 2 }, (_, i) => (17 + 31 * i) % facts.vocab_size);
  const routeRequest = (sessionId = '') => ({ namespace, token_ids: { ids: prompt }, session_id: sessionId });

  // Route, then Generate (greedy) on the best worker.
  const first = await unary(router, 'Route', routeRequest());
  assert.ok(first.workers.length >= 1 && !first.degraded);
  const sampling = { max_tokens: 8, temperature: 0, ignore_eos: true };
  const generateRequest = { namespace, prompt_token_ids: prompt, sampling };
  assert.ok(first.workers[0].ticket.startsWith('kvtt_'));
  const run1 = await generate(first.workers[0], generateRequest);
  assert.equal(run1.tokens.length, 8);
  assert.equal(run1.final.finish_reason, 'FINISH_REASON_LENGTH');
  assert.equal(run1.final.usage.prompt_tokens, prompt.length);
  assert.equal(run1.final.usage.cached_tokens, 0);
  assert.equal(await health(first.workers[0].address), 'SERVING');
  assert.ok((await listServices(first.workers[0].address)).includes('kvtier.v1.Worker'));

  // The second request finds the prefix: Route sees it, Generate reuses it (whole pages only).
  const cachedTokens = Math.floor(prompt.length / pageSize) * pageSize;
  let second;
  for (let i = 0; i < 200; i += 1) {
    second = await unary(router, 'Route', routeRequest());
    if (second.workers[0].matched_tokens.hbm_tokens === cachedTokens) break;
    await sleep(50);
  }
  assert.equal(second.workers[0].matched_tokens.hbm_tokens, cachedTokens);
  const run2 = await generate(second.workers[0], generateRequest);
  assert.equal(run2.final.usage.cached_tokens, cachedTokens);
  assert.deepEqual(run2.tokens, run1.tokens);

  // Sessions: a Route starts one; Pause, Returning, End (idempotent); a Pause alone starts one too.
  await unary(router, 'Route', routeRequest('node-s1'));
  const paused = await unary(sessions, 'Pause', { session_id: 'node-s1', tool_name: 'search', expected_ms: '200' });
  assert.equal(paused.session.state, 'SESSION_STATE_PAUSED');
  assert.equal((await unary(sessions, 'Returning', { session_id: 'node-s1' })).session.state, 'SESSION_STATE_RESUMING');
  assert.equal((await unary(sessions, 'End', { session_id: 'node-s1' })).session.state, 'SESSION_STATE_ENDED');
  assert.equal((await unary(sessions, 'End', { session_id: 'node-s1' })).session.state, 'SESSION_STATE_ENDED');
  const started = await unary(sessions, 'Pause', { session_id: 'node-s2', tool_name: 'search' });
  assert.equal(started.session.state, 'SESSION_STATE_PAUSED');
  expectError(await failure(unary(sessions, 'Returning', { session_id: 'node-nobody' })), grpc.status.NOT_FOUND,
    'session_id');
  expectError(await failure(unary(sessions, 'Pause', { session_id: 'node-s1', tool_name: 'x' })),
    grpc.status.FAILED_PRECONDITION, 'session_id');

  // Admin: refused to the frontend role, answered with the admin token.
  const denied = await failure(unary(admin, 'Status', {}));
  assert.equal(denied.code, grpc.status.PERMISSION_DENIED);
  details(denied);
  const status = await unary(admin, 'Status', {}, ADMIN_TOKEN);
  assert.equal(status.is_leader, true);
  assert.equal((await unary(admin, 'ListWorkers', {}, ADMIN_TOKEN)).workers.length, 1);
  assert.equal((await failure(unary(router, 'Route', routeRequest(), null))).code, grpc.status.UNAUTHENTICATED);

  // Bad input: each answer names the field, in the standard details.
  const unserved = expectError(
    await failure(unary(router, 'Route', { ...routeRequest(), namespace: { ...namespace, weights_digest: '' } })),
    grpc.status.NOT_FOUND, 'namespace.weights_digest');
  assert.ok(unserved.ResourceInfo.resource_type === 'namespace');
  assert.ok(unserved.BadRequest.field_violations[0].description.includes(namespace.weights_digest));
  expectError(
    await failure(generate(first.workers[0], { ...generateRequest, namespace: { ...namespace, rope_config: '' } })),
    grpc.status.NOT_FOUND, 'namespace.rope_config');
  expectError(await failure(unary(router, 'Route', { token_ids: { ids: prompt } })), grpc.status.INVALID_ARGUMENT,
    'namespace');
  expectError(await failure(unary(router, 'Route', { ...routeRequest(), namespace: { ...namespace, tenant: 'other' } })),
    grpc.status.PERMISSION_DENIED, 'namespace.tenant');
  expectError(
    await failure(generate(first.workers[0], { ...generateRequest, prompt_token_ids: [facts.vocab_size] })),
    grpc.status.INVALID_ARGUMENT);
  expectError(await failure(unary(sessions, 'End', { session_id: '' })), grpc.status.INVALID_ARGUMENT, 'session_id');

  router.close();
  sessions.close();
  admin.close();
  console.log(JSON.stringify({ namespace, prompt, tokens: run1.tokens }));
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
