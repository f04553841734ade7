//! Every fuzz target over its seeds and a few thousand deterministic
//! mutations of them (bit flips, truncations, spliced bytes), so that `make
//! test` holds the targets' promises without a fuzzing engine. A failure here
//! is a panic inside the parser, or a file written outside a bundle.
#![allow(clippy::unwrap_used, reason = "tests fail loudly")]

use base64::Engine as _;

/// Mutations tried per seed of a parser that works in memory.
const MUTATIONS: usize = 400;

/// Mutations tried per seed of the tar target, which extracts each to disk.
const TAR_MUTATIONS: usize = 100;

/// A small xorshift generator: the same mutations on every run.
struct Mutator(u64);

impl Mutator {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % (n.max(1) as u64)).unwrap()
    }

    fn mutate(&mut self, seed: &[u8]) -> Vec<u8> {
        let mut data = seed.to_vec();
        for _ in 0..=self.below(4) {
            match self.below(4) {
                0 if !data.is_empty() => {
                    let at = self.below(data.len());
                    data[at] ^= 1 << self.below(8);
                }
                1 if !data.is_empty() => {
                    let at = self.below(data.len());
                    data.truncate(at);
                }
                2 => {
                    let at = self.below(data.len() + 1);
                    let byte = u8::try_from(self.next() & 0xff).unwrap();
                    data.insert(at, byte);
                }
                _ if !data.is_empty() => {
                    let at = self.below(data.len());
                    data[at] = [0x00, 0xff, b'/', b'.', b'"', b'{'][self.below(6)];
                }
                _ => data.push(0),
            }
        }
        data
    }
}

fn run(target: fn(&[u8]), seeds: &[Vec<u8>], mutations: usize) {
    let mut mutator = Mutator(0x9e37_79b9_7f4a_7c15);
    for seed in seeds {
        target(seed);
        for _ in 0..mutations {
            target(&mutator.mutate(seed));
        }
    }
    target(&[]);
}

fn tar_of(entries: &[(&str, tar::EntryType, &[u8], Option<&str>)]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for (path, kind, body, link) in entries {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(*kind);
        header.set_mode(0o644);
        header.set_size(body.len() as u64);
        // Written raw, so that names the tar crate itself refuses to write
        // (absolute, `..`) reach the extractor as an attacker would send them.
        let name = &mut header.as_old_mut().name;
        name[..path.len()].copy_from_slice(path.as_bytes());
        if let Some(link) = link {
            header.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
        }
        header.set_cksum();
        builder.append(&header, *body).unwrap();
    }
    builder.into_inner().unwrap()
}

fn gzip(data: &[u8]) -> Vec<u8> {
    use std::io::Write as _;
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(data).unwrap();
    encoder.finish().unwrap()
}

#[test]
fn csr_target_survives_its_seeds_and_their_mutations() {
    let (csr_pem, _key) = berth_mtls::generate_csr("fuzz").unwrap();
    let base64: String = csr_pem.lines().filter(|line| !line.starts_with("-----")).collect();
    let der = base64::engine::general_purpose::STANDARD.decode(base64).unwrap();
    let seeds = [csr_pem.into_bytes(), der, b"-----BEGIN CERTIFICATE REQUEST-----\n".to_vec()];
    run(berth_fuzz::csr, &seeds, MUTATIONS);
}

#[test]
fn bundle_config_target_survives_its_seeds_and_their_mutations() {
    let config = br#"{"entrypoint":"bin/server","args":["--port","8080"],"env":{"A":"b"},"ports":[],"modules":[{"path":"bin/server","digest":"sha256:0000000000000000000000000000000000000000000000000000000000000000","size":12}]}"#;
    run(berth_fuzz::bundle_config, &[config.to_vec(), b"{}".to_vec(), b"[]".to_vec()], MUTATIONS);
}

#[test]
fn bundle_manifest_target_survives_its_seeds_and_their_mutations() {
    let digest = "sha256:0000000000000000000000000000000000000000000000000000000000000000";
    let manifest = format!(
        r#"{{"schemaVersion":2,"mediaType":"{}","artifactType":"{}","config":{{"mediaType":"{}","digest":"{digest}","size":10}},"layers":[{{"mediaType":"{}","digest":"{digest}","size":20}}]}}"#,
        berth_bundle::OCI_MANIFEST_MEDIA_TYPE,
        berth_bundle::BUNDLE_ARTIFACT_TYPE,
        berth_bundle::BUNDLE_CONFIG_MEDIA_TYPE,
        berth_bundle::LAYER_TAR_GZIP_MEDIA_TYPE,
    );
    run(berth_fuzz::bundle_manifest, &[manifest.into_bytes()], MUTATIONS);
}

#[test]
fn tar_layer_target_survives_hostile_layers_and_their_mutations() {
    let plain = tar_of(&[
        ("bin/", tar::EntryType::Directory, b"", None),
        ("bin/server", tar::EntryType::Regular, b"#!/bin/sh\necho hi\n", None),
        ("bin/alias", tar::EntryType::Symlink, b"", Some("server")),
    ]);
    let hostile = [
        tar_of(&[("../escaped", tar::EntryType::Regular, b"out", None)]),
        tar_of(&[("/tmp/absolute", tar::EntryType::Regular, b"out", None)]),
        tar_of(&[
            ("link", tar::EntryType::Symlink, b"", Some("..")),
            ("link/escaped", tar::EntryType::Regular, b"out", None),
        ]),
        tar_of(&[("hard", tar::EntryType::Link, b"", Some("../../etc/passwd"))]),
        tar_of(&[("dev", tar::EntryType::Char, b"", None)]),
    ];
    let mut seeds = vec![plain.clone(), gzip(&plain)];
    for layer in hostile {
        seeds.push(gzip(&layer));
        seeds.push(layer);
    }
    run(berth_fuzz::tar_layer, &seeds, TAR_MUTATIONS);
}
