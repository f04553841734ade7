//! Redis pub/sub: one task owns a dedicated connection and fans each channel's
//! messages out to its subscribers in this process.
//!
//! # Expected flow
//! [`PubSubHandle::subscribe`] asks the task, which sends `SUBSCRIBE` only for
//! the first local subscriber of a channel and answers once Redis has confirmed
//! it, so anything published afterwards is delivered. Dropping the last
//! subscriber of a channel unsubscribes it.
//!
//! # Losing the connection
//! A closed socket, or a keepalive `PING` left unanswered, ends the connection.
//! The task reconnects with a doubling backoff, re-subscribes every channel
//! that still has subscribers, and only then sends each of them a
//! [`BusMessage::Gap`]: messages published in between are lost, and a consumer
//! that resyncs on `Gap` sees everything published after it. While the
//! connection is down, new subscriptions fail with [`BusError::Unavailable`].
//!
//! # Lifetime
//! The task runs while any [`crate::Bus`] or [`Subscription`] over it lives,
//! and closes the connection when the last one is dropped.

use std::collections::HashMap;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::{Stream, StreamExt};
use redis::aio::{PubSub, PubSubSink, PubSubStream};
use redis::{Client, Msg, Value};
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio::time::{Duration, MissedTickBehavior};

use crate::BusError;
use crate::backend::{BusMessage, Subscription};
use crate::error::{PubSubStopped, Reconnecting};
use crate::memory::DEFAULT_TOPIC_CAPACITY;
use crate::redis_calls::{RedisTimings, bounded};

/// The handle through which a [`crate::RedisBus`] reaches its pub/sub task.
#[derive(Clone, Debug)]
pub(crate) struct PubSubHandle {
    commands: mpsc::UnboundedSender<Command>,
}

#[derive(Debug)]
enum Command {
    /// Add a local subscriber to `channel`.
    Subscribe { channel: String, reply: oneshot::Sender<Result<broadcast::Receiver<BusMessage>, BusError>> },
    /// A subscriber of `channel` went away; unsubscribe if it was the last.
    Release { channel: String },
}

impl PubSubHandle {
    /// Opens the pub/sub connection (one bounded attempt) and starts its task.
    pub(crate) async fn start(client: Client, address: String, timings: RedisTimings) -> Result<Self, BusError> {
        let connection = connect(&client, &address, &timings).await?;
        let (commands, inbox) = mpsc::unbounded_channel();
        let task = PubSubTask { client, address, timings, inbox, channels: HashMap::new() };
        tokio::spawn(task.run(connection));
        Ok(Self { commands })
    }

    /// Subscribes to `channel`; resolves once Redis delivers its messages to us.
    pub(crate) async fn subscribe(&self, channel: &str) -> Result<Subscription, BusError> {
        let (reply, answer) = oneshot::channel();
        let stopped = || BusError::internal("subscribe", PubSubStopped);
        self.commands.send(Command::Subscribe { channel: channel.to_owned(), reply }).map_err(|_| stopped())?;
        let receiver = answer.await.map_err(|_| stopped())??;
        Ok(Subscription::new(Releasing {
            messages: Some(Subscription::from_broadcast(receiver)),
            channel: channel.to_owned(),
            commands: self.commands.clone(),
        }))
    }
}

/// A subscriber's stream that tells the task when it is dropped.
struct Releasing {
    messages: Option<Subscription>,
    channel: String,
    commands: mpsc::UnboundedSender<Command>,
}

impl Stream for Releasing {
    type Item = BusMessage;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<BusMessage>> {
        match self.messages.as_mut() {
            Some(messages) => messages.poll_next_unpin(cx),
            None => Poll::Ready(None),
        }
    }
}

impl Drop for Releasing {
    fn drop(&mut self) {
        // The receiver goes first, so the task counts one subscriber fewer when it looks.
        self.messages = None;
        let channel = std::mem::take(&mut self.channel);
        // A stopped task has nothing left to unsubscribe.
        let _ = self.commands.send(Command::Release { channel });
    }
}

/// Why the task stopped serving a connection.
enum Outcome {
    /// The connection is gone; reconnect.
    Lost,
    /// Every handle is gone; stop.
    Shutdown,
}

struct PubSubTask {
    client: Client,
    address: String,
    timings: RedisTimings,
    inbox: mpsc::UnboundedReceiver<Command>,
    /// Local fan-out per subscribed channel.
    channels: HashMap<String, broadcast::Sender<BusMessage>>,
}

impl PubSubTask {
    async fn run(mut self, first: PubSub) {
        let mut connection = Some(first);
        let mut backoff = self.timings.reconnect_backoff_min;
        loop {
            if let Some(established) = connection.take() {
                backoff = self.timings.reconnect_backoff_min;
                let (sink, stream) = established.split();
                match self.serve(sink, stream).await {
                    Outcome::Shutdown => return,
                    Outcome::Lost => tracing::warn!(
                        address = %self.address,
                        "bus pub/sub connection lost; subscribers will see a gap",
                    ),
                }
            }
            if let Outcome::Shutdown = self.wait_disconnected(backoff).await {
                return;
            }
            backoff = (backoff * 2).min(self.timings.reconnect_backoff_max);
            match self.reconnect().await {
                Ok(established) => {
                    tracing::info!(address = %self.address, "bus pub/sub connection restored");
                    connection = Some(established);
                }
                Err(error) => tracing::warn!(
                    address = %self.address,
                    error = %error,
                    retry_in = ?backoff,
                    "bus pub/sub reconnect failed",
                ),
            }
        }
    }

    /// Relays messages and commands until the connection is lost or every handle is gone.
    async fn serve(&mut self, mut sink: PubSubSink, mut stream: PubSubStream) -> Outcome {
        let mut keepalive = tokio::time::interval(self.timings.keepalive_interval);
        keepalive.set_missed_tick_behavior(MissedTickBehavior::Delay);
        // The first tick is immediate and the connection was just proven alive.
        keepalive.tick().await;
        loop {
            tokio::select! {
                message = stream.next() => match message {
                    Some(message) => self.dispatch(&message),
                    None => return Outcome::Lost,
                },
                command = self.inbox.recv() => match command {
                    None => return Outcome::Shutdown,
                    Some(Command::Subscribe { channel, reply }) => {
                        let result = self.add_subscriber(&mut sink, channel).await;
                        let lost = matches!(&result, Err(error) if error.is_unavailable());
                        let _ = reply.send(result);
                        if lost {
                            return Outcome::Lost;
                        }
                    }
                    Some(Command::Release { channel }) => {
                        if self.forget_if_unused(&channel) {
                            self.unsubscribe(&mut sink, &[channel]).await;
                        }
                    }
                },
                _ = keepalive.tick() => {
                    let ping = bounded(
                        &self.address,
                        "ping",
                        self.timings.command_timeout,
                        sink.ping::<Value>(),
                    );
                    if ping.await.is_err() {
                        return Outcome::Lost;
                    }
                    // A release that raced a new subscription may have left a channel unused.
                    let unused: Vec<String> = self
                        .channels
                        .iter()
                        .filter(|(_, fan_out)| fan_out.receiver_count() == 0)
                        .map(|(channel, _)| channel.clone())
                        .collect();
                    if !unused.is_empty() {
                        for channel in &unused {
                            self.channels.remove(channel);
                        }
                        self.unsubscribe(&mut sink, &unused).await;
                    }
                }
            }
        }
    }

    /// Answers commands while disconnected: `Lost` once `pause` has passed (so
    /// reconnect), `Shutdown` if every handle went away meanwhile.
    async fn wait_disconnected(&mut self, pause: Duration) -> Outcome {
        let resume = tokio::time::sleep(pause);
        tokio::pin!(resume);
        loop {
            tokio::select! {
                () = &mut resume => return Outcome::Lost,
                command = self.inbox.recv() => match command {
                    None => return Outcome::Shutdown,
                    Some(Command::Subscribe { reply, .. }) => {
                        let _ = reply.send(Err(BusError::Unavailable {
                            address: self.address.clone(),
                            source: Box::new(Reconnecting),
                        }));
                    }
                    Some(Command::Release { channel }) => {
                        self.forget_if_unused(&channel);
                    }
                },
            }
        }
    }

    /// Opens a new connection, re-subscribes every channel still in use, then signals the gap.
    async fn reconnect(&mut self) -> Result<PubSub, BusError> {
        let mut connection = connect(&self.client, &self.address, &self.timings).await?;
        self.channels.retain(|_, fan_out| fan_out.receiver_count() > 0);
        let channels: Vec<&str> = self.channels.keys().map(String::as_str).collect();
        if !channels.is_empty() {
            bounded(&self.address, "subscribe", self.timings.command_timeout, connection.subscribe(&channels)).await?;
        }
        for fan_out in self.channels.values() {
            let _ = fan_out.send(BusMessage::Gap);
        }
        Ok(connection)
    }

    async fn add_subscriber(
        &mut self,
        sink: &mut PubSubSink,
        channel: String,
    ) -> Result<broadcast::Receiver<BusMessage>, BusError> {
        if let Some(fan_out) = self.channels.get(&channel) {
            return Ok(fan_out.subscribe());
        }
        bounded(&self.address, "subscribe", self.timings.command_timeout, sink.subscribe(&channel)).await?;
        let (fan_out, receiver) = broadcast::channel(DEFAULT_TOPIC_CAPACITY);
        self.channels.insert(channel, fan_out);
        Ok(receiver)
    }

    async fn unsubscribe(&self, sink: &mut PubSubSink, channels: &[String]) {
        let unsubscribed =
            bounded(&self.address, "unsubscribe", self.timings.command_timeout, sink.unsubscribe(channels));
        // Failing here costs only unwanted messages, which are dropped; a
        // broken connection is caught by the keepalive.
        if let Err(error) = unsubscribed.await {
            tracing::debug!(address = %self.address, error = %error, "bus unsubscribe failed");
        }
    }

    /// Drops `channel` if nobody listens to it any more; whether it did.
    fn forget_if_unused(&mut self, channel: &str) -> bool {
        let unused = self.channels.get(channel).is_some_and(|fan_out| fan_out.receiver_count() == 0);
        if unused {
            self.channels.remove(channel);
        }
        unused
    }

    fn dispatch(&self, message: &Msg) {
        if let Some(fan_out) = self.channels.get(message.get_channel_name()) {
            // No receivers left: the release is already on its way.
            let _ = fan_out.send(BusMessage::Payload(Bytes::copy_from_slice(message.get_payload_bytes())));
        }
    }
}

async fn connect(client: &Client, address: &str, timings: &RedisTimings) -> Result<PubSub, BusError> {
    bounded(address, "connect", timings.connect_timeout, client.get_async_pubsub()).await.map_err(|error| match error {
        // Whatever stops the first connection, the server is not usable from here.
        BusError::Internal { source, .. } => BusError::Unavailable { address: address.to_owned(), source },
        other => other,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn dropping_a_subscription_tells_the_task_after_releasing_its_receiver() {
        let (commands, mut inbox) = mpsc::unbounded_channel();
        let (fan_out, receiver) = broadcast::channel(4);
        let subscription = Releasing {
            messages: Some(Subscription::from_broadcast(receiver)),
            channel: "p:topic:t".to_owned(),
            commands,
        };
        assert_eq!(fan_out.receiver_count(), 1);
        drop(subscription);
        match inbox.recv().await {
            Some(Command::Release { channel }) => assert_eq!(channel, "p:topic:t"),
            other => panic!("expected a release, got {other:?}"),
        }
        assert_eq!(fan_out.receiver_count(), 0);
    }
}
