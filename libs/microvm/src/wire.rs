//! What the node and a guest's init say to each other.
//!
//! The node speaks on the control port in frames: one tag byte, a
//! big-endian `u32` length and that many bytes of payload. The command to
//! run travels as JSON (it is sent once per lease, and JSON names a wrong
//! field); a signal as its number. Encoding and decoding are pure functions
//! over byte buffers, so the async node and the blocking init share them.
//!
//! The init answers on the status port in lines of text ([`Status`]),
//! which QEMU appends to a file: the node reads them whenever it looks,
//! even after its own restart, and an operator can read them with `cat`.
//! The workload's output is not framed at all: its stdout and stderr are
//! ports of their own, written by QEMU straight into the lease's logs.

use serde::{Deserialize, Serialize};

/// The largest payload a frame may carry.
pub const MAX_FRAME: usize = 1 << 20;

/// How many bytes precede a frame's payload.
const HEADER: usize = 5;

/// What the init runs, as the node sends it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestCommand {
    /// The program and its arguments; the program is looked up on the
    /// `PATH` of `env` when it has no slash.
    pub argv: Vec<String>,
    /// The workload's whole environment.
    pub env: Vec<(String, String)>,
    /// Its working directory inside the root.
    pub cwd: String,
    /// The user it runs as inside the guest.
    pub uid: u32,
    /// The group it runs as inside the guest.
    pub gid: u32,
    /// The guest's host name.
    pub hostname: String,
    /// The guest's network interface, when it has one.
    #[serde(default)]
    pub network: Option<GuestNetwork>,
    /// How many processes the workload's user may have at once; 0 for no
    /// limit but the VM's memory.
    #[serde(default)]
    pub max_processes: u64,
    /// The most memory the workload and all it starts may hold, in bytes,
    /// held by a memory cgroup inside the guest (the guest's own kernel
    /// and init live beside it); 0 for no limit but the VM's memory.
    #[serde(default)]
    pub memory_limit_bytes: u64,
    /// Directories of the node's the guest mounts inside the workload's
    /// root, in order (a path beneath an earlier one is mounted over it).
    #[serde(default)]
    pub shares: Vec<GuestShare>,
    /// A Unix socket the init listens on inside the workload's root, each
    /// connection to it relayed to an address of the guest's network (the
    /// node's Workload API, which QEMU hands each connection to): the
    /// workload's `$SPIFFE_ENDPOINT_SOCKET`.
    #[serde(default)]
    pub workload_api: Option<GuestRelay>,
}

/// A socket inside the guest relayed to an address outside it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestRelay {
    /// The socket's path inside the workload's root; it is the workload's
    /// user's, and no other user's (0600).
    pub path: String,
    /// `IP:PORT` of the guest's network each connection is relayed to.
    pub address: String,
}

/// A directory of the node's shared with the guest over virtio-fs: the VMM
/// has a `vhost-user-fs` device tagged [`GuestShare::tag`], served by a
/// `virtiofsd` of the node's for that one directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestShare {
    /// The device's tag: what the guest mounts it by.
    pub tag: String,
    /// Where the workload sees it: an absolute path inside its root.
    pub path: String,
    /// Mounted read-only (the node's daemon refuses writes as well).
    pub read_only: bool,
}

/// How the init sets up the guest's one network interface (`eth0`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestNetwork {
    /// Its address with prefix length, `10.0.2.15/24`.
    pub address: String,
    /// The default route's gateway.
    pub gateway: String,
    /// The workload's `/etc/resolv.conf`.
    pub resolv_conf: String,
    /// The workload's ports the node forwards to this address: the init
    /// reports each on the status port ([`Status::Listening`]) once
    /// something in the guest listens on it, for the node's forward
    /// accepts a connection whether or not anything does.
    #[serde(default)]
    pub inbound: Vec<u16>,
}

/// How a workload ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestExit {
    /// It exited with this status.
    Code(i32),
    /// A signal with this number ended it.
    Signal(i32),
    /// The guest's kernel killed it for going past its memory limit.
    OutOfMemory,
}

/// One frame from the node to the init.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Run this (sent once, first).
    Run(Box<GuestCommand>),
    /// Send this signal to the workload and all it started.
    Signal(i32),
}

/// What the workload uses inside its guest, as the init reads it from the
/// workload's cgroup when the node asks on the stats port: one byte (a
/// nonzero tag) asks, one line (`stats TAG CPU_USEC MEMORY_BYTES`) answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestStats {
    /// CPU time of every process of the workload, user and system, µs.
    pub cpu_usec: u64,
    /// Memory its cgroup is charged, bytes.
    pub memory_bytes: u64,
}

impl GuestStats {
    /// The answer to the question tagged `tag`, newline included.
    pub fn answer(&self, tag: u8) -> String {
        format!("stats {tag} {} {}\n", self.cpu_usec, self.memory_bytes)
    }

    /// The answer to the question tagged `tag` among the whole lines of
    /// `text`, if one is there; answers to other questions are passed over.
    pub fn parse_answer(text: &str, tag: u8) -> Option<Self> {
        let whole = &text[..text.rfind('\n')? + 1];
        whole.lines().rev().find_map(|line| {
            let mut words = line.strip_prefix("stats ")?.split(' ');
            (words.next()?.parse::<u8>().ok()? == tag).then_some(())?;
            let cpu_usec = words.next()?.parse().ok()?;
            let memory_bytes = words.next()?.parse().ok()?;
            words.next().is_none().then_some(Self { cpu_usec, memory_bytes })
        })
    }
}

/// One line the init writes on the status port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    /// The workload runs, with this pid inside the guest.
    Started(u32),
    /// The init reports [`Status::Listening`] for these inbound ports
    /// (written before [`Status::Started`], so a node that reads the start
    /// knows whether to wait for them; an init without inbound ports, or
    /// one older than the report, never writes it).
    Watching(Vec<u16>),
    /// Something in the guest listens on this inbound port (reported once
    /// per port, after [`Status::Started`] and never after the exit).
    Listening(u16),
    /// The workload ended; the VM powers off next.
    Exited(GuestExit),
    /// The workload could not be started, and why; the VM powers off next.
    Failed(String),
}

impl Status {
    /// The line, newline included.
    pub fn line(&self) -> String {
        match self {
            Status::Started(pid) => format!("started {pid}\n"),
            Status::Watching(ports) => {
                format!("watching {}\n", ports.iter().map(u16::to_string).collect::<Vec<_>>().join(" "))
            }
            Status::Listening(port) => format!("listening {port}\n"),
            Status::Exited(GuestExit::Code(code)) => format!("exited {code}\n"),
            Status::Exited(GuestExit::Signal(signal)) => format!("killed {signal}\n"),
            Status::Exited(GuestExit::OutOfMemory) => "oom-killed 9\n".to_owned(),
            // One line, whatever the reason says.
            Status::Failed(why) => format!("failed {}\n", why.replace('\n', " ")),
        }
    }

    /// The statuses in `text`, in order; a line that is not one (a partial
    /// last line, say) is skipped.
    pub fn parse_all(text: &str) -> Vec<Status> {
        text.lines()
            .filter_map(|line| {
                let (word, rest) = line.split_once(' ')?;
                match word {
                    "started" => rest.parse().ok().map(Status::Started),
                    "watching" => {
                        rest.split(' ').map(|port| port.parse().ok()).collect::<Option<_>>().map(Status::Watching)
                    }
                    "listening" => rest.parse().ok().map(Status::Listening),
                    "exited" => rest.parse().ok().map(|code| Status::Exited(GuestExit::Code(code))),
                    "killed" => rest.parse().ok().map(|signal| Status::Exited(GuestExit::Signal(signal))),
                    "oom-killed" => Some(Status::Exited(GuestExit::OutOfMemory)),
                    "failed" => Some(Status::Failed(rest.to_owned())),
                    _ => None,
                }
            })
            .collect()
    }
}

/// A frame that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The length field says more than [`MAX_FRAME`].
    #[error("a frame of {0} bytes is longer than the {MAX_FRAME} allowed")]
    TooLong(usize),
    /// The tag names no frame.
    #[error("unknown frame tag {0}")]
    UnknownTag(u8),
    /// The payload does not hold what the tag says.
    #[error("malformed {what} frame: {why}")]
    Malformed {
        /// Which frame.
        what: &'static str,
        /// What was wrong with it.
        why: String,
    },
}

const RUN: u8 = 1;
const SIGNAL: u8 = 2;

/// The bytes of `frame`.
pub fn encode(frame: &Frame) -> Vec<u8> {
    let (tag, payload): (u8, Vec<u8>) = match frame {
        Frame::Run(command) => (RUN, serde_json::to_vec(command).unwrap_or_default()),
        Frame::Signal(signal) => (SIGNAL, signal.to_be_bytes().to_vec()),
    };
    let mut bytes = Vec::with_capacity(HEADER + payload.len());
    bytes.push(tag);
    bytes.extend_from_slice(&u32::try_from(payload.len()).unwrap_or(u32::MAX).to_be_bytes());
    bytes.extend_from_slice(&payload);
    bytes
}

/// The first whole frame at the start of `buffer` and how many bytes it
/// took, or `None` while more bytes are needed.
pub fn decode(buffer: &[u8]) -> Result<Option<(Frame, usize)>, WireError> {
    let Some(header) = buffer.get(..HEADER) else { return Ok(None) };
    let tag = header[0];
    let length =
        usize::try_from(u32::from_be_bytes([header[1], header[2], header[3], header[4]])).unwrap_or(usize::MAX);
    if length > MAX_FRAME {
        return Err(WireError::TooLong(length));
    }
    let Some(payload) = buffer.get(HEADER..HEADER + length) else { return Ok(None) };
    let frame = match tag {
        RUN => Frame::Run(serde_json::from_slice(payload).map_err(|e| malformed("run", e))?),
        SIGNAL => Frame::Signal(i32::from_be_bytes(four("signal", payload)?)),
        other => return Err(WireError::UnknownTag(other)),
    };
    Ok(Some((frame, HEADER + length)))
}

/// Frames read from a byte stream as its bytes arrive.
#[derive(Debug, Default)]
pub struct Decoder {
    buffer: Vec<u8>,
}

impl Decoder {
    /// Adds bytes read from the stream.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buffer.extend_from_slice(bytes);
    }

    /// The next whole frame, if the bytes so far hold one.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, WireError> {
        match decode(&self.buffer)? {
            Some((frame, used)) => {
                self.buffer.drain(..used);
                Ok(Some(frame))
            }
            None => Ok(None),
        }
    }
}

fn four(what: &'static str, payload: &[u8]) -> Result<[u8; 4], WireError> {
    payload.try_into().map_err(|_| WireError::Malformed { what, why: format!("{} bytes, not 4", payload.len()) })
}

fn malformed(what: &'static str, error: impl std::fmt::Display) -> WireError {
    WireError::Malformed { what, why: error.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn command() -> GuestCommand {
        GuestCommand {
            argv: vec!["/bin/sh".into(), "-c".into(), "echo hi".into()],
            env: vec![("PATH".into(), "/bin".into())],
            cwd: "/".into(),
            uid: 1000,
            gid: 1000,
            hostname: "lease-1".into(),
            max_processes: 1024,
            memory_limit_bytes: 0,
            network: Some(GuestNetwork {
                address: "10.0.2.15/24".into(),
                gateway: "10.0.2.2".into(),
                resolv_conf: "nameserver 10.0.2.2\n".into(),
                inbound: vec![8080, 8081],
            }),
            shares: vec![GuestShare { tag: "share0".into(), path: "/usr".into(), read_only: true }],
            workload_api: Some(GuestRelay { path: "/api.sock".into(), address: "10.0.2.100:81".into() }),
        }
    }

    #[test]
    fn every_frame_reads_back_as_written_even_a_byte_at_a_time() {
        let frames = vec![Frame::Run(Box::new(command())), Frame::Signal(15), Frame::Signal(-1)];
        let bytes: Vec<u8> = frames.iter().flat_map(encode).collect();
        let mut decoder = Decoder::default();
        let mut read = Vec::new();
        for byte in bytes {
            decoder.push(&[byte]);
            while let Some(frame) = decoder.next_frame().unwrap() {
                read.push(frame);
            }
        }
        assert_eq!(read, frames);
    }

    #[test]
    fn status_lines_read_back_and_a_partial_line_is_skipped() {
        let statuses = [
            Status::Watching(vec![8080, 8081]),
            Status::Started(42),
            Status::Listening(8080),
            Status::Exited(GuestExit::Code(-1)),
            Status::Exited(GuestExit::Signal(9)),
            Status::Exited(GuestExit::OutOfMemory),
            Status::Failed("cannot run /bin/nope:\nno such file".into()),
        ];
        let mut text: String = statuses.iter().map(Status::line).collect();
        assert_eq!(text.lines().count(), 7, "a reason is kept to one line");
        text.push_str("listening 99999\nwatching 80 x\nexi");
        let read = Status::parse_all(&text);
        assert_eq!(read[..6], statuses[..6]);
        assert_eq!(read[6], Status::Failed("cannot run /bin/nope: no such file".into()));
        assert_eq!(read.len(), 7, "a port out of range or not a number is no status: {read:?}");
    }

    #[test]
    fn bad_frames_are_named_not_panicked_on() {
        let mut too_long = vec![SIGNAL];
        too_long.extend_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(decode(&too_long), Err(WireError::TooLong(u32::MAX as usize)));
        assert_eq!(decode(&[99, 0, 0, 0, 0]), Err(WireError::UnknownTag(99)));
        let short_signal = [SIGNAL, 0, 0, 0, 2, 0, 15];
        assert!(matches!(decode(&short_signal), Err(WireError::Malformed { what: "signal", .. })));
        let mut bad_run = vec![RUN, 0, 0, 0, 2];
        bad_run.extend_from_slice(b"{}");
        let error = decode(&bad_run).unwrap_err().to_string();
        assert!(error.contains("malformed run frame") && error.contains("argv"), "{error}");
        assert_eq!(decode(&[SIGNAL, 0, 0]), Ok(None), "a partial header waits for more");
    }

    #[test]
    fn a_stats_answer_reads_back_by_its_tag_and_a_broken_or_partial_one_is_not_taken() {
        let stats = GuestStats { cpu_usec: 1_500_000, memory_bytes: 64 << 20 };
        assert_eq!(stats.answer(7), "stats 7 1500000 67108864\n");
        assert_eq!(GuestStats::parse_answer(&stats.answer(7), 7), Some(stats));
        // An answer to an earlier question, late, is not this one's.
        let late = GuestStats { cpu_usec: 2, memory_bytes: 3 };
        let both = format!("{}{}", late.answer(6), stats.answer(7));
        assert_eq!(GuestStats::parse_answer(&both, 7), Some(stats));
        assert_eq!(GuestStats::parse_answer(&late.answer(6), 7), None);
        for broken in ["", "stats 7 1\n", "stats 7 1 2 3\n", "stats 7 x 2\n", "stats 7 1 2", "stats 300 1 2\n"] {
            assert_eq!(GuestStats::parse_answer(broken, 7), None, "{broken:?}");
        }
    }
}
