//! Reading an instance's output for `GetLogs`: the last lines first, then,
//! when following, what is written after, until the instance ends or the
//! caller hangs up.
//!
//! # Invariants
//! - Output is read from the files the provider writes, never held in
//!   memory whole: a tail is found by reading backwards in blocks.
//! - When following, whether the instance has ended is checked *before* the
//!   files are read, so everything written up to its end is sent before the
//!   stream closes.
//! - Standard output and standard error are separate files; each chunk says
//!   which it came from, and `tail_lines` counts lines of each.

use std::fs::File;
use std::io::{Read as _, Seek as _, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use berth_proto::types::v1::{LogChunk, LogStream};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::board::InstanceBoard;
use crate::provider::LogFiles;

/// The most bytes one chunk carries.
const CHUNK_BYTES: usize = 64 * 1024;

/// How far back a tail is searched per read.
const TAIL_BLOCK: usize = 16 * 1024;

/// One output file and how far it has been sent.
#[derive(Debug)]
struct Source {
    stream: LogStream,
    path: PathBuf,
    offset: u64,
}

/// What a `GetLogs` call asked for.
#[derive(Debug)]
pub(crate) struct LogRequest {
    pub(crate) lease_id: String,
    pub(crate) files: LogFiles,
    pub(crate) tail_lines: u32,
    pub(crate) follow: bool,
    pub(crate) poll: Duration,
}

/// Sends the instance's output into `out` as the request says; returns when
/// done, when the caller hangs up, or on `shutdown`.
pub(crate) async fn stream_logs(
    request: LogRequest,
    board: InstanceBoard,
    out: mpsc::Sender<Result<LogChunk, tonic::Status>>,
    shutdown: CancellationToken,
) {
    let LogRequest { lease_id, files, tail_lines, follow, poll } = request;
    let mut sources = [
        Source { stream: LogStream::Stdout, path: files.stdout, offset: 0 },
        Source { stream: LogStream::Stderr, path: files.stderr, offset: 0 },
    ];
    for source in &mut sources {
        let path = source.path.clone();
        source.offset = match blocking(move || tail_start(&path, tail_lines)).await {
            Ok(start) => start,
            Err(error) => {
                let _ =
                    out.send(Err(tonic::Status::internal(format!("cannot read the instance's output: {error}")))).await;
                return;
            }
        };
    }
    loop {
        let over = !follow || board.get(&lease_id).is_none_or(|view| view.is_over());
        for source in &mut sources {
            if !send_new_output(source, &out).await {
                return;
            }
        }
        if over {
            return;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = out.closed() => return,
            _ = tokio::time::sleep(poll) => {}
        }
    }
}

/// Sends whatever `source` gained since its offset. False once the caller
/// is gone (or the file cannot be read, which is said to the caller).
async fn send_new_output(source: &mut Source, out: &mpsc::Sender<Result<LogChunk, tonic::Status>>) -> bool {
    loop {
        let (path, offset) = (source.path.clone(), source.offset);
        let read = match blocking(move || read_from(&path, offset)).await {
            Ok(read) => read,
            Err(error) => {
                let _ =
                    out.send(Err(tonic::Status::internal(format!("cannot read the instance's output: {error}")))).await;
                return false;
            }
        };
        let (data, next_offset) = read;
        source.offset = next_offset;
        if data.is_empty() {
            return true;
        }
        let chunk =
            LogChunk { data, stream: source.stream as i32, at: Some(prost_types::Timestamp::from(SystemTime::now())) };
        if out.send(Ok(chunk)).await.is_err() {
            return false;
        }
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> std::io::Result<T> + Send + 'static) -> std::io::Result<T> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
}

/// Up to [`CHUNK_BYTES`] from `offset`, and the offset after them. A file
/// shorter than `offset` was started afresh: it is read from its start. A
/// file not there yet reads as empty.
fn read_from(path: &Path, offset: u64) -> std::io::Result<(Vec<u8>, u64)> {
    let mut file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), offset)),
        Err(e) => return Err(e),
    };
    let size = file.metadata()?.len();
    let offset = if size < offset { 0 } else { offset };
    file.seek(SeekFrom::Start(offset))?;
    let mut data = Vec::with_capacity(CHUNK_BYTES.min((size - offset) as usize));
    file.take(CHUNK_BYTES as u64).read_to_end(&mut data)?;
    let next = offset + data.len() as u64;
    Ok((data, next))
}

/// Where the last `lines` lines of the file start; 0 for every line (or a
/// file not there yet). A final newline ends the last line rather than
/// starting an empty one.
fn tail_start(path: &Path, lines: u32) -> std::io::Result<u64> {
    if lines == 0 {
        return Ok(0);
    }
    let mut file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let size = file.metadata()?.len();
    let mut remaining = lines;
    let mut end = size;
    let mut block = vec![0u8; TAIL_BLOCK];
    while end > 0 {
        let len = TAIL_BLOCK.min(end as usize);
        let start = end - len as u64;
        file.seek(SeekFrom::Start(start))?;
        file.read_exact(&mut block[..len])?;
        for (i, byte) in block[..len].iter().enumerate().rev() {
            let at = start + i as u64;
            if *byte != b'\n' || at + 1 == size {
                continue;
            }
            remaining -= 1;
            if remaining == 0 {
                return Ok(at + 1);
            }
        }
        end = start;
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_with(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.log");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    fn tail(path: &Path, lines: u32) -> String {
        let start = tail_start(path, lines).unwrap();
        let text = std::fs::read_to_string(path).unwrap();
        text[start as usize..].to_string()
    }

    #[test]
    fn a_tail_is_the_last_lines_with_or_without_a_final_newline() {
        let (_dir, path) = file_with("one\ntwo\nthree\n");
        assert_eq!(tail(&path, 1), "three\n");
        assert_eq!(tail(&path, 2), "two\nthree\n");
        assert_eq!(tail(&path, 10), "one\ntwo\nthree\n");
        assert_eq!(tail(&path, 0), "one\ntwo\nthree\n", "0 is everything");
        let (_dir, path) = file_with("one\ntwo\npartial");
        assert_eq!(tail(&path, 1), "partial");
        assert_eq!(tail(&path, 2), "two\npartial");
    }

    #[test]
    fn a_tail_is_found_across_blocks_of_a_big_file() {
        let text: String = (0..10_000).map(|i| format!("line {i}\n")).collect();
        let (_dir, path) = file_with(&text);
        assert_eq!(tail(&path, 3), "line 9997\nline 9998\nline 9999\n");
        let start = tail_start(&path, 5000).unwrap() as usize;
        assert!(text[start..].starts_with("line 5000\n"));
    }

    #[test]
    fn missing_files_read_as_empty_and_a_restarted_file_from_its_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("none.log");
        assert_eq!(tail_start(&path, 5).unwrap(), 0);
        assert_eq!(read_from(&path, 7).unwrap(), (Vec::new(), 7));
        std::fs::write(&path, "new").unwrap();
        assert_eq!(read_from(&path, 100).unwrap(), (b"new".to_vec(), 3));
    }

    #[test]
    fn reads_are_cut_into_chunks() {
        let (_dir, path) = file_with(&"x".repeat(CHUNK_BYTES + 10));
        let (first, offset) = read_from(&path, 0).unwrap();
        assert_eq!((first.len(), offset), (CHUNK_BYTES, CHUNK_BYTES as u64));
        let (rest, end) = read_from(&path, offset).unwrap();
        assert_eq!((rest.len(), end), (10, CHUNK_BYTES as u64 + 10));
    }
}
