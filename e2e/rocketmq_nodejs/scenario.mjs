// Drives the official RocketMQ 5 Node.js client against an Apogee cluster, through its public
// API only, and prints one JSON line per observation for e2e/test_rocketmq_nodejs.py to check.
//   node scenario.mjs '{"endpoints": "...", "topics": {...}, "groups": {...}}'
import { ConsumeResult, Producer, PushConsumer, SimpleConsumer } from 'rocketmq-client-nodejs';

const cfg = JSON.parse(process.argv[2]);
const { endpoints, topics, groups } = cfg;
const say = (what, data) => console.log(JSON.stringify({ what, ...data }));
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const COMMIT = 1; // TransactionResolution.COMMIT
const view = (m) => ({
  id: m.messageId,
  topic: m.topic,
  body: m.body.toString(),
  tag: m.tag ?? null,
  keys: m.keys,
  properties: Object.fromEntries(m.properties ?? []),
  attempt: m.deliveryAttempt,
  group: m.messageGroup ?? null,
});

async function drain(consumer, want, ms) {
  const got = [];
  const until = Date.now() + ms;
  while (got.length < want && Date.now() < until) {
    for (const m of await consumer.receive(16, 20000)) {
      got.push({ ...view(m), at: Date.now() });
      await consumer.ack(m);
    }
  }
  return got;
}

const checked = [];
const producer = new Producer({
  endpoints,
  topics: [topics.normal, topics.fifo, topics.delay, topics.txn],
  checker: { async check(m) { checked.push(m.body.toString()); return COMMIT; } },
});
const simple = new SimpleConsumer({
  endpoints,
  consumerGroup: groups.simple,
  subscriptions: new Map([[topics.normal, 'a || b'], [topics.fifo, '*'], [topics.delay, '*'], [topics.txn, '*']]),
  awaitDuration: 1000, // a receive that finds nothing (another topic was picked) costs 1 s
});
await simple.startup();
await producer.startup();
try {
  // normal: tags a and b pass the filter, c does not
  for (const [i, tag] of ['a', 'b', 'c'].entries()) {
    const r = await producer.send({
      topic: topics.normal, tag, keys: [`k${i}`], properties: new Map([['color', 'blue']]),
      body: Buffer.from(`normal ${i}`),
    });
    say('sent', { topic: 'normal', id: r.messageId });
  }
  // FIFO: two message groups, five each, interleaved
  for (let i = 0; i < 5; i++) {
    for (const g of ['g1', 'g2']) {
      await producer.send({ topic: topics.fifo, messageGroup: g, body: Buffer.from(`${g}-${i}`) });
    }
  }
  // delay: two due in 2 s, the second recalled at once
  const sentAt = Date.now();
  await producer.send({ topic: topics.delay, delay: 2000, body: Buffer.from('kept') });
  const recalled = await producer.send({ topic: topics.delay, delay: 2000, body: Buffer.from('recalled') });
  const rr = await producer.recallMessage(topics.delay, recalled.recallHandle);
  say('recalled', { id: rr.messageId, sent: recalled.messageId, sentAt });
  // transactions: one committed, one rolled back, one left for the check
  for (const end of ['commit', 'rollback', 'check']) {
    const tx = producer.beginTransaction();
    await producer.send({ topic: topics.txn, body: Buffer.from(`tx-${end}`) }, tx);
    if (end === 'commit') await tx.commit();
    if (end === 'rollback') await tx.rollback();
  }
  // 2 + 10 + 1 + 2 (commit, check) to receive
  const got = await drain(simple, 15, 60000);
  say('received', { messages: got });
  await sleep(1000); // the recalled message's due time passed a second ago: it must not come
  say('after', { messages: await drain(simple, 1, 4000), checked });

  // PushConsumer: the listener fails the first delivery of one message
  const seen = [];
  const push = new PushConsumer({
    endpoints,
    consumerGroup: groups.push,
    subscriptions: new Map([[topics.normal, '*']]),
    messageListener: {
      async consume(m) {
        seen.push({ body: m.body.toString(), attempt: m.deliveryAttempt });
        return m.body.toString() === 'normal 1' && m.deliveryAttempt === 1
          ? ConsumeResult.FAILURE : ConsumeResult.SUCCESS;
      },
    },
  });
  await push.startup();
  await producer.send({ topic: topics.normal, tag: 'a', body: Buffer.from('normal 1') });
  const until = Date.now() + 30000;
  while (Date.now() < until && !seen.some((s) => s.attempt === 2)) await sleep(100);
  say('pushed', { seen });
  await push.shutdown().catch(() => {});
} finally {
  await simple.shutdown().catch(() => {});
  await producer.shutdown().catch(() => {});
}
say('done', {});
process.exit(0);
