// A Node client of Loadmaster, for the contract tests (tests/e2e/test_node_client.py) and as an
// example for TypeScript users (docs/clients.md). It loads protos/ at run time with
// @grpc/proto-loader, as a Node user would, and checks against a running suite:
//   KServe ModelInfer and ModelStreamInfer, gRPC health, reflection v1, one internal RPC with the
//   internal credential, and the ZMQ edge (an Observation out, a ModelResponse back).
//
//   node check.mjs '{"gateway":"127.0.0.1:8001","edge":"tcp://127.0.0.1:5555",
//                    "scheduler":"127.0.0.1:50051","identityKey":"lmid1:node/check:..."}'
//
// Prints one JSON line per check ({"check", "ok", "detail"}) and exits 1 when one failed.

import { createHmac } from "node:crypto";
import { createRequire } from "node:module";
import path from "node:path";
import { fileURLToPath } from "node:url";

import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";
import protobuf from "protobufjs";
import * as zmq from "zeromq";

const require = createRequire(import.meta.url);
const here = path.dirname(fileURLToPath(import.meta.url));
const PROTOS = path.resolve(here, "..", "..", "protos");
const HEALTH_PROTO = require.resolve("grpc-health-check/proto/health/v1/health.proto");
const REFLECTION_PROTO = path.join(
  path.dirname(require.resolve("@grpc/reflection/package.json")),
  "build/proto/grpc/reflection/v1/reflection.proto",
);
const LOADER = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true };
const DEADLINE_MS = 10_000;

const target = JSON.parse(process.argv[2] ?? "{}");
let failed = 0;

function report(check, ok, detail) {
  if (!ok) failed += 1;
  console.log(JSON.stringify({ check, ok, detail }));
}

async function run(check, body) {
  try {
    const detail = await body();
    report(check, true, detail);
  } catch (error) {
    report(check, false, String(error?.stack ?? error));
  }
}

function load(file, includeDirs) {
  return grpc.loadPackageDefinition(protoLoader.loadSync(file, { ...LOADER, includeDirs }));
}

const deadline = () => new Date(Date.now() + DEADLINE_MS);

function unary(client, method, request, metadata = new grpc.Metadata()) {
  return new Promise((resolve, reject) => {
    client[method](request, metadata, { deadline: deadline() }, (error, reply) =>
      error ? reject(error) : resolve(reply),
    );
  });
}

function float32Bytes(values) {
  return Buffer.from(new Float32Array(values).buffer);
}

function float32Values(buffer) {
  const copy = Buffer.from(buffer); // aligned
  return Array.from(new Float32Array(copy.buffer, copy.byteOffset, copy.length / 4));
}

function inferRequest(id, values) {
  return {
    model_name: "double",
    id,
    inputs: [{ name: "x", datatype: "FP32", shape: [1, values.length] }],
    raw_input_contents: [float32Bytes(values)],
  };
}

const kserve = load("inference/grpc_service.proto", [path.join(PROTOS, "kserve")]).inference;
const inference = new kserve.GRPCInferenceService(target.gateway, grpc.credentials.createInsecure());

await run("kserve ModelInfer", async () => {
  const reply = await unary(inference, "ModelInfer", inferRequest("node-1", [1, 2, 3, 4]));
  const doubled = float32Values(reply.raw_output_contents[0]);
  if (JSON.stringify(doubled) !== JSON.stringify([2, 4, 6, 8])) throw new Error(`got ${doubled}`);
  return { model: reply.model_name, outputs: doubled };
});

await run("kserve ModelStreamInfer", async () => {
  const call = inference.ModelStreamInfer({ deadline: deadline() });
  const replies = new Promise((resolve, reject) => {
    const got = [];
    call.on("data", (reply) => {
      if (reply.error_message) return reject(new Error(reply.error_message));
      got.push([reply.infer_response.id, float32Values(reply.infer_response.raw_output_contents[0])]);
      if (got.length === 3) {
        call.end();
        resolve(got);
      }
    });
    call.on("error", reject);
  });
  for (const i of [1, 2, 3]) call.write(inferRequest(`stream-${i}`, [i, i]));
  const got = await replies;
  const expected = [1, 2, 3].map((i) => [`stream-${i}`, [2 * i, 2 * i]]);
  if (JSON.stringify(got) !== JSON.stringify(expected)) throw new Error(`got ${JSON.stringify(got)}`);
  return got;
});

await run("grpc health", async () => {
  const health = load(HEALTH_PROTO, []).grpc.health.v1;
  const client = new health.Health(target.gateway, grpc.credentials.createInsecure());
  const reply = await unary(client, "Check", { service: "" });
  if (reply.status !== "SERVING") throw new Error(`status ${reply.status}`);
  return reply.status;
});

await run("reflection v1", async () => {
  const reflection = load(REFLECTION_PROTO, []).grpc.reflection.v1;
  const client = new reflection.ServerReflection(target.gateway, grpc.credentials.createInsecure());
  const call = client.ServerReflectionInfo({ deadline: deadline() });
  const listed = new Promise((resolve, reject) => {
    call.on("data", (reply) => {
      call.end();
      if (reply.error_response) return reject(new Error(reply.error_response.error_message));
      resolve(reply.list_services_response.service.map((s) => s.name));
    });
    call.on("error", reject);
  });
  call.write({ host: "", list_services: "" });
  const names = await listed;
  if (!names.includes("inference.GRPCInferenceService")) throw new Error(`listed ${names}`);
  return names;
});

function signed(method) {
  // The internal credential (docs/security.md): an identity key `lmid1:<identity>:<hex key>`;
  // the MAC is HMAC-SHA256(key, "grpc\n<identity>\n<full method>\n<unix ns>").
  const body = target.identityKey.slice("lmid1:".length);
  const cut = body.lastIndexOf(":");
  const identity = body.slice(0, cut);
  const key = Buffer.from(body.slice(cut + 1), "hex");
  const now = (BigInt(Date.now()) * 1_000_000n).toString();
  const mac = createHmac("sha256", key).update(["grpc", identity, method, now].join("\n")).digest("hex");
  const metadata = new grpc.Metadata();
  metadata.set("x-loadmaster-identity", identity);
  metadata.set("x-loadmaster-auth", `${now}.${mac}`);
  return metadata;
}

await run("internal RPC with the internal credential", async () => {
  const v1 = load("loadmaster/v1/scheduler.proto", [PROTOS]).loadmaster.v1;
  const scheduler = new v1.SchedulerService(target.scheduler, grpc.credentials.createInsecure());
  let refused = "";
  try {
    await unary(scheduler, "ListWorkers", {});
  } catch (error) {
    refused = grpc.status[error.code];
  }
  if (refused !== "UNAUTHENTICATED") throw new Error(`unsigned call: ${refused || "accepted"}`);
  const reply = await unary(scheduler, "ListWorkers", {}, signed("/loadmaster.v1.SchedulerService/ListWorkers"));
  if (!reply.workers.length) throw new Error("no workers listed");
  return { unsigned: refused, workers: reply.workers.map((w) => w.worker_id) };
});

await run("zmq edge Observation -> ModelResponse", async () => {
  const root = new protobuf.Root();
  root.resolvePath = (_origin, target) => path.join(PROTOS, target);
  await root.load("loadmaster/v1/edge.proto", { keepCase: true });
  const Observation = root.lookupType("loadmaster.v1.Observation");
  const ModelResponse = root.lookupType("loadmaster.v1.ModelResponse");
  const Dtype = root.lookupEnum("loadmaster.v1.Dtype");
  const payload = float32Bytes([0.5, 1.5, 2.5]);
  const observation = Observation.encode(
    Observation.create({
      client: { id: "node-edge", type: "node" },
      timestamp_ns: Date.now() * 1_000_000,
      model_id: "double",
      tensors: [
        { key: "x", dtype: Dtype.values.DTYPE_FLOAT32, shape: [3], byte_offset: 0, byte_length: payload.length },
      ],
    }),
  ).finish();
  const socket = new zmq.Dealer({ linger: 0, receiveTimeout: DEADLINE_MS });
  socket.connect(target.edge);
  try {
    await socket.send([Buffer.alloc(0), observation, payload]);
    const [, envelope, body] = await socket.receive();
    const response = ModelResponse.decode(envelope);
    if (response.metadata?.error) throw new Error(`error reply: ${response.metadata.error}`);
    const tensor = response.tensors[0];
    const start = Number(tensor.byte_offset);
    const values = float32Values(body.subarray(start, start + Number(tensor.byte_length)));
    if (JSON.stringify(values) !== JSON.stringify([1, 3, 5])) throw new Error(`got ${values}`);
    return { model: response.model_id, key: tensor.key, values };
  } finally {
    socket.close();
  }
});

inference.close();
process.exit(failed ? 1 : 0);
