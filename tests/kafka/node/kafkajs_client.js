// kafkajs (a pure-JavaScript Kafka client) driven by tests/kafka/test_kafka_node.py against
// FerryMQ's Kafka port: `node kafkajs_client.js '<json command>'` runs one command and prints its
// result as one JSON line on stdout (kafkajs's own log goes to stderr).
//
// Commands (field "cmd"):
//   produce      {brokers, topic, messages: [{key, value, headers, partition}], idempotent}
//                -> {records: [{partition, baseOffset}]}
//   consume      {brokers, topic, groupId, count}: joins the consumer group (classic protocol),
//                reads `count` messages from the beginning, commits them, leaves
//                -> {messages: [{partition, offset, key, value, headers}], memberId, assignment}
//   transaction  {brokers, transactionalId, topic, messages, groupId, offsets: [{topic,
//                partition, offset}], abort}: one transaction: the messages and the group's
//                offsets (sendOffsets), then commit (or abort)
//                -> {records: [{partition, baseOffset}]}
'use strict';

const { Kafka, logLevel } = require('kafkajs');

const stderrLog = () => ({ namespace, level, log }) => {
  const { message, ...extra } = log;
  process.stderr.write(`[kafkajs ${level} ${namespace}] ${message} ${JSON.stringify(extra)}\n`);
};

function client(brokers) {
  return new Kafka({
    clientId: 'ferrymq-node-test',
    brokers,
    logLevel: logLevel.WARN,
    logCreator: stderrLog,
    connectionTimeout: 5000,
    retry: { retries: 5, initialRetryTime: 100 },
  });
}

const text = (b) => (b === null || b === undefined ? null : b.toString('utf8'));
const toBuffer = (s) => (s === null || s === undefined ? null : Buffer.from(s, 'utf8'));

function outgoing(messages) {
  return messages.map((m) => ({
    key: toBuffer(m.key),
    value: toBuffer(m.value),
    partition: m.partition,
    headers: Object.fromEntries(Object.entries(m.headers || {})
      .map(([k, v]) => [k, Array.isArray(v) ? v.map(toBuffer) : toBuffer(v)])),
  }));
}

function records(metadata) {
  return metadata.map((r) => ({ partition: r.partition, baseOffset: Number(r.baseOffset) }));
}

async function produce(cmd) {
  const producer = client(cmd.brokers).producer({
    idempotent: Boolean(cmd.idempotent),
    maxInFlightRequests: cmd.idempotent ? 1 : undefined,
    allowAutoTopicCreation: true,
  });
  await producer.connect();
  try {
    const out = [];
    for (const m of outgoing(cmd.messages)) {  // one request each: every answer's offset
      out.push(...records(await producer.send({ topic: cmd.topic, acks: -1, messages: [m] })));
    }
    return { records: out };
  } finally {
    await producer.disconnect();
  }
}

async function consume(cmd) {
  const consumer = client(cmd.brokers).consumer({
    groupId: cmd.groupId,
    sessionTimeout: 10000,
    heartbeatInterval: 500,
    rebalanceTimeout: 10000,
  });
  const got = [];
  let group = null;
  consumer.on(consumer.events.GROUP_JOIN, (e) => { group = e.payload; });
  await consumer.connect();
  try {
    await consumer.subscribe({ topics: [cmd.topic], fromBeginning: true });
    await new Promise((resolve, reject) => {
      const timer = setTimeout(
        () => reject(new Error(`read ${got.length} of ${cmd.count} messages in 20 s`)), 20000);
      consumer.run({
        autoCommit: false,
        eachMessage: async ({ topic, partition, message }) => {
          got.push({
            partition,
            offset: Number(message.offset),
            key: text(message.key),
            value: text(message.value),
            headers: Object.fromEntries(Object.entries(message.headers || {})
              .map(([k, v]) => [k, Array.isArray(v) ? v.map(text) : text(v)])),
          });
          await consumer.commitOffsets(
            [{ topic, partition, offset: String(Number(message.offset) + 1) }]);
          if (got.length >= cmd.count) {
            clearTimeout(timer);
            resolve();
          }
        },
      }).catch(reject);
    });
  } finally {
    await consumer.disconnect();  // LeaveGroup
  }
  return {
    messages: got,
    memberId: group && group.memberId,
    assignment: group && group.memberAssignment,
  };
}

async function transaction(cmd) {
  const producer = client(cmd.brokers).producer({
    transactionalId: cmd.transactionalId,
    idempotent: true,
    maxInFlightRequests: 1,
  });
  await producer.connect();
  try {
    const txn = await producer.transaction();
    const out = [];
    try {
      out.push(...records(await txn.send({ topic: cmd.topic, messages: outgoing(cmd.messages) })));
      if (cmd.groupId) {
        const byTopic = {};
        for (const o of cmd.offsets) {
          (byTopic[o.topic] = byTopic[o.topic] || []).push(
            { partition: o.partition, offset: String(o.offset) });
        }
        await txn.sendOffsets({
          consumerGroupId: cmd.groupId,
          topics: Object.entries(byTopic).map(([topic, partitions]) => ({ topic, partitions })),
        });
      }
    } catch (e) {
      await txn.abort();
      throw e;
    }
    await (cmd.abort ? txn.abort() : txn.commit());
    return { records: out };
  } finally {
    await producer.disconnect();
  }
}

const COMMANDS = { produce, consume, transaction };

async function main() {
  const cmd = JSON.parse(process.argv[2]);
  const run = COMMANDS[cmd.cmd];
  if (!run) throw new Error(`unknown command ${cmd.cmd}`);
  process.stdout.write(`${JSON.stringify(await run(cmd))}\n`);
}

main().catch((e) => {
  process.stderr.write(`${e.stack || e}\n`);
  process.exit(1);
});
