// kafkajs (a pure-JavaScript Kafka client) driven by tests/kafka/test_kafka_node.py against
// FerryMQ's Kafka port: `node kafkajs_client.js '<json command>'` runs one command and prints its
// result as one JSON line on stdout (kafkajs's own log goes to stderr).
//
// Every command takes {brokers} and, to log in with SASL SCRAM-SHA-256, {sasl: {username,
// password}}; the commands (field "cmd"):
//   produce      {brokers, topic, messages: [{key, value, headers, partition}], idempotent,
//                compression ("gzip": kafkajs's only built-in codec)}
//                -> {records: [{partition, baseOffset}]}
//   consume      {brokers, topic, groupId, count}: joins the consumer group (classic protocol),
//                reads `count` messages from the beginning, commits them, leaves
//                -> {messages: [{partition, offset, key, value, headers}], memberId, assignment}
//   transaction  {brokers, transactionalId, topic, messages, groupId, offsets: [{topic,
//                partition, offset}], abort}: one transaction: the messages and the group's
//                offsets (sendOffsets), then commit (or abort)
//                -> {records: [{partition, baseOffset}]}
//   admin        {brokers, phase, topic, groupId}: the admin client (see admin() below)
//   rebalance    {brokers, topic, partitions, groupId}: two members (see rebalance() below)
'use strict';

const { CompressionTypes, Kafka, logLevel } = require('kafkajs');

const stderrLog = () => ({ namespace, level, log }) => {
  const { message, ...extra } = log;
  process.stderr.write(`[kafkajs ${level} ${namespace}] ${message} ${JSON.stringify(extra)}\n`);
};

function client(cmd) {
  return new Kafka({
    clientId: 'ferrymq-node-test',
    brokers: cmd.brokers,
    sasl: cmd.sasl && { mechanism: 'scram-sha-256', ...cmd.sasl },
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
  const producer = client(cmd).producer({
    idempotent: Boolean(cmd.idempotent),
    maxInFlightRequests: cmd.idempotent ? 1 : undefined,
    allowAutoTopicCreation: true,
  });
  await producer.connect();
  try {
    const out = [];
    for (const m of outgoing(cmd.messages)) {  // one request each: every answer's offset
      out.push(...records(await producer.send({
        topic: cmd.topic,
        acks: -1,
        compression: cmd.compression === 'gzip' ? CompressionTypes.GZIP : CompressionTypes.None,
        messages: [m],
      })));
    }
    return { records: out };
  } finally {
    await producer.disconnect();
  }
}

async function consume(cmd) {
  const consumer = client(cmd).consumer({
    groupId: cmd.groupId,
    sessionTimeout: 10000,
    heartbeatInterval: 500,
    rebalanceTimeout: 10000,
    maxWaitTimeInMs: 500,  // disconnect() waits for the fetch under way
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
  const producer = client(cmd).producer({
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

// admin, phase "create": CreateTopics (3 partitions, retention.ms), Metadata, DescribeConfigs
//   -> {created, topics, partitions, configs}
// admin, phase "inspect": ListOffsets, ListGroups, DescribeGroups, OffsetFetch of groupId on
//   topic, then DeleteGroups and DeleteTopics
//   -> {offsets, groups, described, groupOffsets, deletedGroups, topicsAfter}
async function admin(cmd) {
  const a = client(cmd).admin();
  await a.connect();
  try {
    if (cmd.phase === 'create') {
      const created = await a.createTopics({
        topics: [{
          topic: cmd.topic,
          numPartitions: 3,
          configEntries: [{ name: 'retention.ms', value: '3600000' }],
        }],
        waitForLeaders: true,
      });
      const [meta] = (await a.fetchTopicMetadata({ topics: [cmd.topic] })).topics;
      const described = await a.describeConfigs({
        resources: [{ type: 2, name: cmd.topic, configNames: ['retention.ms'] }],
        includeSynonyms: false,
      });
      return {
        created,
        topics: (await a.listTopics()).sort(),
        partitions: meta.partitions.map((p) => p.partitionId).sort(),
        configs: Object.fromEntries(described.resources[0].configEntries
          .map((e) => [e.configName, e.configValue])),
      };
    }
    const out = {};
    out.offsets = (await a.fetchTopicOffsets(cmd.topic))
      .map((o) => ({ partition: o.partition, low: Number(o.low), high: Number(o.high) }))
      .sort((x, y) => x.partition - y.partition);
    out.groups = (await a.listGroups()).groups.sort((x, y) => x.groupId.localeCompare(y.groupId));
    out.described = (await a.describeGroups([cmd.groupId])).groups
      .map((g) => ({ groupId: g.groupId, state: g.state, members: g.members.length }));
    const [fetched] = await a.fetchOffsets({ groupId: cmd.groupId, topics: [cmd.topic] });
    out.groupOffsets = fetched.partitions
      .map((p) => ({ partition: p.partition, offset: Number(p.offset) }))
      .sort((x, y) => x.partition - y.partition);
    out.deletedGroups = (await a.deleteGroups([cmd.groupId]))
      .map((g) => ({ groupId: g.groupId, errorCode: g.errorCode }));
    await a.deleteTopics({ topics: [cmd.topic] });
    out.topicsAfter = (await a.listTopics()).sort();
    return out;
  } finally {
    await a.disconnect();
  }
}

// rebalance {brokers, topic, partitions, groupId}: member a joins alone, b joins (the group
//   rebalances: a's heartbeat is answered REBALANCE_IN_PROGRESS, a rejoins), b leaves (a takes
//   everything back), then one message is produced to each partition and a reads them
//   -> {phases: [{a: [partitions], b: [partitions]}, ...], readByA: [{partition, value}]}
async function rebalance(cmd) {
  const kafka = client(cmd);
  const all = [...Array(cmd.partitions).keys()];
  const latest = { a: null, b: null };
  const readByA = [];
  const member = (who) => {
    const c = kafka.consumer({
      groupId: cmd.groupId,
      sessionTimeout: 10000,
      rebalanceTimeout: 10000,
      heartbeatInterval: 200,
      maxWaitTimeInMs: 200,  // a member hears of a rebalance between fetches: keep them short
    });
    c.on(c.events.GROUP_JOIN, (e) => {
      latest[who] = [...(e.payload.memberAssignment[cmd.topic] || [])].sort();
    });
    return c;
  };
  const start = async (who, c) => {
    await c.connect();
    await c.subscribe({ topics: [cmd.topic], fromBeginning: true });
    await c.run({
      eachMessage: async ({ partition, message }) => {
        if (who === 'a') readByA.push({ partition, value: text(message.value) });
      },
    });
  };
  const until = (what, cond) => new Promise((resolve, reject) => {
    const deadline = Date.now() + 20000;
    const tick = () => {
      if (cond()) resolve();
      else if (Date.now() > deadline) reject(new Error(`timed out: ${what} ${JSON.stringify(latest)}`));
      else setTimeout(tick, 20);
    };
    tick();
  });
  const same = (x, y) => JSON.stringify(x) === JSON.stringify(y);
  const phases = [];
  const a = member('a');
  const b = member('b');
  await start('a', a);
  await until('a alone', () => same(latest.a, all));
  phases.push({ ...latest });
  await start('b', b);
  await until('a and b split the partitions', () => latest.b !== null && latest.b.length > 0
    && latest.a.length > 0 && same([...latest.a, ...latest.b].sort(), all));
  phases.push({ ...latest });
  await b.disconnect();  // LeaveGroup
  latest.b = null;
  await until('a alone again', () => same(latest.a, all));
  phases.push({ ...latest });
  const producer = kafka.producer();
  await producer.connect();
  await producer.send({
    topic: cmd.topic,
    acks: -1,
    messages: all.map((partition) => ({ partition, value: `after-${partition}` })),
  });
  await producer.disconnect();
  await until('a reads what was produced after b left', () => readByA.length >= cmd.partitions);
  await a.disconnect();
  return { phases, readByA };
}

const COMMANDS = { produce, consume, transaction, admin, rebalance };

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
