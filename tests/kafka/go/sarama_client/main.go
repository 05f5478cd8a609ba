// Sarama (Shopify's Go Kafka client, Debian's golang-github-shopify-sarama-dev) driven by
// tests/kafka/test_kafka_go.py against FerryMQ's Kafka port: `sarama_client '<json command>'`
// runs one command and prints its result as one JSON line on stdout (errors on stderr).
//
// Commands (field "cmd"):
//
//	produce  {brokers, topic, messages: [{key, value, partition, headers}], idempotent,
//	         compression: "", "gzip", "snappy", "lz4" or "zstd"}
//	         -> {records: [{partition, offset}]}
//	consume  {brokers, topic, groupId, count}: a consumer group member (JoinGroup, SyncGroup,
//	         Heartbeat, OffsetCommit, LeaveGroup) reads `count` messages from the oldest
//	         offset, marks them, commits, leaves
//	         -> {messages: [{partition, offset, key, value, headers}], claims}
//	rebalance {brokers, topic, partitions, groupId}: member a joins alone, b joins (the group
//	         rebalances: a's heartbeat is answered REBALANCE_IN_PROGRESS, a rejoins), b leaves
//	         (a takes everything back), then one message is produced to each partition and a
//	         reads them -> {phases: [{a: [partitions], b: [partitions]}, ...], readByA}
//
// Built in GOPATH mode against Debian's layout: GO111MODULE=off GOPATH=/usr/share/gocode.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/Shopify/sarama"
)

type header struct {
	Key   string `json:"key"`
	Value string `json:"value"`
}

type message struct {
	Partition int32    `json:"partition"`
	Offset    int64    `json:"offset"`
	Key       *string  `json:"key"`
	Value     *string  `json:"value"`
	Headers   []header `json:"headers"`
}

type command struct {
	Cmd         string    `json:"cmd"`
	Brokers     []string  `json:"brokers"`
	Topic       string    `json:"topic"`
	Messages    []message `json:"messages"`
	Idempotent  bool      `json:"idempotent"`
	GroupID     string    `json:"groupId"`
	Count       int       `json:"count"`
	Compression string    `json:"compression"`
	Partitions  int       `json:"partitions"`
}

var codecs = map[string]sarama.CompressionCodec{"": sarama.CompressionNone,
	"gzip": sarama.CompressionGZIP, "snappy": sarama.CompressionSnappy,
	"lz4": sarama.CompressionLZ4, "zstd": sarama.CompressionZSTD}

func config() *sarama.Config {
	c := sarama.NewConfig()
	c.ClientID = "ferrymq-go-test"
	c.Version = sarama.V2_1_0_0 // record batches (magic 2), headers, idempotence
	c.Metadata.Retry.Backoff = 100 * time.Millisecond
	c.Net.DialTimeout = 5 * time.Second
	return c
}

func text(b []byte) *string {
	if b == nil {
		return nil
	}
	s := string(b)
	return &s
}

func bytesOf(s *string) sarama.Encoder {
	if s == nil {
		return nil
	}
	return sarama.ByteEncoder(*s)
}

func produce(cmd command) (interface{}, error) {
	c := config()
	c.Producer.RequiredAcks = sarama.WaitForAll
	c.Producer.Return.Successes = true
	c.Producer.Partitioner = sarama.NewManualPartitioner
	codec, ok := codecs[cmd.Compression]
	if !ok {
		return nil, fmt.Errorf("unknown compression %q", cmd.Compression)
	}
	c.Producer.Compression = codec
	if cmd.Idempotent {
		c.Producer.Idempotent = true
		c.Net.MaxOpenRequests = 1
		c.Producer.Retry.Max = 5
	}
	p, err := sarama.NewSyncProducer(cmd.Brokers, c)
	if err != nil {
		return nil, err
	}
	defer p.Close()
	records := []map[string]interface{}{}
	for _, m := range cmd.Messages {
		pm := &sarama.ProducerMessage{Topic: cmd.Topic, Partition: m.Partition,
			Key: bytesOf(m.Key), Value: bytesOf(m.Value)}
		for _, h := range m.Headers {
			pm.Headers = append(pm.Headers, sarama.RecordHeader{Key: []byte(h.Key), Value: []byte(h.Value)})
		}
		partition, offset, err := p.SendMessage(pm)
		if err != nil {
			return nil, err
		}
		records = append(records, map[string]interface{}{"partition": partition, "offset": offset})
	}
	return map[string]interface{}{"records": records}, nil
}

// reader is the consumer group handler: it keeps what it read and its latest claims.
type reader struct {
	mu     sync.Mutex
	got    []message
	claims map[string][]int32
}

func newReader() *reader { return &reader{got: []message{}} }

func (r *reader) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.got)
}

// claimed is the reader's partitions of topic in its latest generation, sorted.
func (r *reader) claimed(topic string) []int32 {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := append([]int32{}, r.claims[topic]...)
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

func (r *reader) Setup(s sarama.ConsumerGroupSession) error {
	r.mu.Lock()
	r.claims = s.Claims()
	r.mu.Unlock()
	return nil
}

func (r *reader) Cleanup(sarama.ConsumerGroupSession) error { return nil }

func (r *reader) ConsumeClaim(s sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	for msg := range claim.Messages() {
		m := message{Partition: msg.Partition, Offset: msg.Offset, Key: text(msg.Key),
			Value: text(msg.Value), Headers: []header{}}
		for _, h := range msg.Headers {
			m.Headers = append(m.Headers, header{Key: string(h.Key), Value: string(h.Value)})
		}
		s.MarkMessage(msg, "")
		r.mu.Lock()
		r.got = append(r.got, m)
		r.mu.Unlock()
	}
	return nil
}

// member is one consumer group member reading into a reader until stopped.
type member struct {
	group  sarama.ConsumerGroup
	cancel context.CancelFunc
	errs   chan error
}

func join(cmd command, r *reader) (*member, error) {
	c := config()
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	c.Consumer.Offsets.CommitInterval = 100 * time.Millisecond
	// a retention time makes Sarama send OffsetCommit v2 (v0-1, which Kafka 4.0 no longer
	// serves either, carry a per-partition timestamp)
	c.Consumer.Offsets.Retention = 24 * time.Hour
	c.Consumer.Return.Errors = true
	c.Consumer.Group.Session.Timeout = 10 * time.Second
	c.Consumer.Group.Heartbeat.Interval = 200 * time.Millisecond // hears of rebalances soon
	c.Consumer.Group.Rebalance.Timeout = 10 * time.Second
	g, err := sarama.NewConsumerGroup(cmd.Brokers, cmd.GroupID, c)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	m := &member{group: g, cancel: cancel, errs: make(chan error, 2)}
	go func() {
		for ctx.Err() == nil { // each Consume is one generation: a rebalance ends it
			if err := g.Consume(ctx, []string{cmd.Topic}, r); err != nil {
				m.errs <- err
				return
			}
		}
	}()
	go func() {
		for err := range g.Errors() {
			select {
			case m.errs <- err:
			default:
			}
		}
	}()
	return m, nil
}

// stop commits what was marked and leaves the group.
func (m *member) stop() error {
	m.cancel()
	return m.group.Close()
}

// until waits for cond, failing on a member's error or after 20 s.
func until(what string, cond func() bool, members ...*member) error {
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		for _, m := range members {
			select {
			case err := <-m.errs:
				return fmt.Errorf("%s: %v", what, err)
			default:
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out: %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return nil
}

func consume(cmd command) (interface{}, error) {
	r := newReader()
	m, err := join(cmd, r)
	if err != nil {
		return nil, err
	}
	failure := until(fmt.Sprintf("read %d messages", cmd.Count), func() bool {
		return r.count() >= cmd.Count
	}, m)
	if err := m.stop(); err != nil && failure == nil {
		failure = err
	}
	if failure != nil {
		return nil, failure
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return map[string]interface{}{"messages": r.got, "claims": r.claims}, nil
}

func rebalance(cmd command) (interface{}, error) {
	all := make([]int32, cmd.Partitions)
	for i := range all {
		all[i] = int32(i)
	}
	same := func(x, y []int32) bool { return fmt.Sprint(x) == fmt.Sprint(y) }
	ra, rb := newReader(), newReader()
	a, err := join(cmd, ra)
	if err != nil {
		return nil, err
	}
	defer a.stop()
	phases := []map[string][]int32{}
	if err := until("a alone", func() bool { return same(ra.claimed(cmd.Topic), all) }, a); err != nil {
		return nil, err
	}
	phases = append(phases, map[string][]int32{"a": ra.claimed(cmd.Topic)})
	b, err := join(cmd, rb)
	if err != nil {
		return nil, err
	}
	if err := until("a and b split the partitions", func() bool {
		ca, cb := ra.claimed(cmd.Topic), rb.claimed(cmd.Topic)
		both := append(append([]int32{}, ca...), cb...)
		sort.Slice(both, func(i, j int) bool { return both[i] < both[j] })
		return len(ca) > 0 && len(cb) > 0 && same(both, all)
	}, a, b); err != nil {
		return nil, err
	}
	phases = append(phases, map[string][]int32{"a": ra.claimed(cmd.Topic), "b": rb.claimed(cmd.Topic)})
	if err := b.stop(); err != nil { // LeaveGroup
		return nil, err
	}
	if err := until("a alone again", func() bool { return same(ra.claimed(cmd.Topic), all) }, a); err != nil {
		return nil, err
	}
	phases = append(phases, map[string][]int32{"a": ra.claimed(cmd.Topic)})
	after := command{Brokers: cmd.Brokers, Topic: cmd.Topic}
	for _, p := range all {
		v := fmt.Sprintf("after-%d", p)
		after.Messages = append(after.Messages, message{Partition: p, Value: &v})
	}
	if _, err := produce(after); err != nil {
		return nil, err
	}
	if err := until("a reads what was produced after b left", func() bool {
		return ra.count() >= len(all)
	}, a); err != nil {
		return nil, err
	}
	ra.mu.Lock()
	defer ra.mu.Unlock()
	return map[string]interface{}{"phases": phases, "readByA": ra.got}, nil
}

func main() {
	var cmd command
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: sarama_client '<json command>'")
		os.Exit(2)
	}
	if err := json.Unmarshal([]byte(os.Args[1]), &cmd); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	var out interface{}
	var err error
	switch cmd.Cmd {
	case "produce":
		out, err = produce(cmd)
	case "consume":
		out, err = consume(cmd)
	case "rebalance":
		out, err = rebalance(cmd)
	default:
		err = fmt.Errorf("unknown command %q", cmd.Cmd)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
