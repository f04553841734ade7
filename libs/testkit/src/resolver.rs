//! A DNS resolver on the host's loopback that answers every `A` query with
//! one address (and any other type with no record), over UDP and TCP on one
//! port, recording the names it was asked: a project's upstream resolver,
//! so a test sees what left the node and what did not.

use std::io::{Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::sync::{Arc, Mutex};

use hickory_proto::op::{Message, OpCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{RData, Record, RecordType};

/// What [`Resolver::start`] answers every `A` query with.
pub const RESOLVER_ANSWER: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);

/// The resolver; it serves until the test process ends.
#[derive(Debug, Clone)]
pub struct Resolver {
    /// Where it listens, UDP and TCP.
    pub addr: SocketAddr,
    asked: Arc<Mutex<Vec<String>>>,
}

impl Resolver {
    /// Starts one on `127.0.0.1` on a free port.
    pub fn start() -> Self {
        // A free UDP port may be taken for TCP: try others until both are free.
        let (udp, addr, tcp) = (0..50)
            .find_map(|_| {
                let udp = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).ok()?;
                let addr = udp.local_addr().ok()?;
                let tcp = TcpListener::bind(addr).ok()?;
                Some((udp, addr, tcp))
            })
            .expect("no loopback port free for both UDP and TCP in 50 tries");
        let asked = Arc::new(Mutex::new(Vec::new()));
        let names = asked.clone();
        std::thread::spawn(move || {
            let mut buffer = [0u8; 4096];
            while let Ok((len, client)) = udp.recv_from(&mut buffer) {
                if let Some(reply) = answer(&buffer[..len], &names) {
                    let _ = udp.send_to(&reply, client);
                }
            }
        });
        let names = asked.clone();
        std::thread::spawn(move || {
            for stream in tcp.incoming() {
                let Ok(mut stream) = stream else { continue };
                let mut len = [0u8; 2];
                if stream.read_exact(&mut len).is_err() {
                    continue;
                }
                let mut query = vec![0u8; usize::from(u16::from_be_bytes(len))];
                if stream.read_exact(&mut query).is_err() {
                    continue;
                }
                if let Some(reply) = answer(&query, &names) {
                    let len = u16::try_from(reply.len()).unwrap().to_be_bytes();
                    let _ = stream.write_all(&len).and_then(|()| stream.write_all(&reply));
                }
            }
        });
        Self { addr, asked }
    }

    /// The names asked so far, in order, without the trailing dot.
    pub fn asked(&self) -> Vec<String> {
        self.asked.lock().unwrap().clone()
    }
}

fn answer(query: &[u8], names: &Mutex<Vec<String>>) -> Option<Vec<u8>> {
    let query = Message::from_vec(query).ok()?;
    let mut response = Message::response(query.metadata.id, OpCode::Query);
    response.metadata.recursion_available = true;
    response.add_queries(query.queries.iter().cloned());
    let question = query.queries.first()?;
    names.lock().unwrap().push(question.name().to_ascii().trim_end_matches('.').to_string());
    if question.query_type() == RecordType::A {
        response.add_answer(Record::from_rdata(question.name().clone(), 60, RData::A(A(RESOLVER_ANSWER))));
    }
    response.to_vec().ok()
}
