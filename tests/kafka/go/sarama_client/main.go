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
//
// Built in GOPATH mode against Debian's layout: GO111MODULE=off GOPATH=/usr/share/gocode.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
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

// reader is the consumer group handler: it keeps what it read and says when it has enough.
type reader struct {
	mu     sync.Mutex
	got    []message
	claims map[string][]int32
	want   int
	done   chan struct{}
	once   sync.Once
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
		if len(r.got) >= r.want {
			r.once.Do(func() { close(r.done) })
		}
		r.mu.Unlock()
	}
	return nil
}

func consume(cmd command) (interface{}, error) {
	c := config()
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	c.Consumer.Offsets.CommitInterval = 100 * time.Millisecond
	// a retention time makes Sarama send OffsetCommit v2 (v0-1, which Kafka 4.0 no longer
	// serves either, carry a per-partition timestamp)
	c.Consumer.Offsets.Retention = 24 * time.Hour
	c.Consumer.Return.Errors = true
	g, err := sarama.NewConsumerGroup(cmd.Brokers, cmd.GroupID, c)
	if err != nil {
		return nil, err
	}
	r := &reader{want: cmd.Count, done: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	errs := make(chan error, 1)
	go func() {
		for ctx.Err() == nil {
			if err := g.Consume(ctx, []string{cmd.Topic}, r); err != nil {
				errs <- err
				return
			}
		}
	}()
	var failure error
	select {
	case <-r.done:
	case failure = <-errs:
	case failure = <-g.Errors():
	case <-time.After(20 * time.Second):
		failure = fmt.Errorf("read %d of %d messages in 20 s", len(r.got), cmd.Count)
	}
	cancel()
	if err := g.Close(); err != nil && failure == nil { // commits what was marked, leaves
		failure = err
	}
	if failure != nil {
		return nil, failure
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return map[string]interface{}{"messages": r.got, "claims": r.claims}, nil
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
