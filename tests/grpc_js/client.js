// A gRPC client in another language for tests/test_grpc_interop.py: Node's @grpc/grpc-js against the
// daemon's gRPC port. Usage: node client.js HOST:PORT PROTO_FILE; prints one JSON line of results.
"use strict";
const grpc = require("@grpc/grpc-js");
const loader = require("@grpc/proto-loader");

const [target, protoFile] = process.argv.slice(2);
const definition = loader.loadSync(protoFile, { keepCase: true, longs: String, defaults: true });
const katsubushi = grpc.loadPackageDefinition(definition).katsubushi;
const generator = new katsubushi.Generator(target, grpc.credentials.createInsecure());
const stats = new katsubushi.Stats(target, grpc.credentials.createInsecure());
const deadline = () => new Date(Date.now() + 10000);

function call(client, method, request) {
  return new Promise((resolve) => {
    client[method](request, { deadline: deadline() }, (error, reply) => {
      if (error) resolve({ code: error.code, details: error.details, reason: error.metadata.get("katsubushi-reason") });
      else resolve({ code: 0, reply });
    });
  });
}

function unknown() {
  return new Promise((resolve) => {
    const raw = generator.makeUnaryRequest(
      "/katsubushi.Generator/Nope", (x) => x, (x) => x, Buffer.alloc(0), { deadline: deadline() },
      (error) => resolve({ code: error ? error.code : 0, details: error ? error.details : "" }),
    );
    return raw;
  });
}

async function main() {
  const out = {};
  out.fetch = [];
  for (let i = 0; i < 20; i++) out.fetch.push((await call(generator, "Fetch", {})).reply.id);
  // 200 calls at once on the one channel: concurrent streams on one connection.
  const many = await Promise.all(Array.from({ length: 200 }, () => call(generator, "Fetch", {})));
  out.concurrent = many.map((r) => (r.code === 0 ? r.reply.id : `error ${r.code}`));
  out.multi = (await call(generator, "FetchMulti", { n: 100 })).reply.ids;
  out.multi_default = (await call(generator, "FetchMulti", {})).reply.ids;
  out.too_many = await call(generator, "FetchMulti", { n: 1001 });
  out.stats = (await call(stats, "Get", {})).reply;
  out.unknown = await unknown();
  generator.close();
  stats.close();
  console.log(JSON.stringify(out));
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
