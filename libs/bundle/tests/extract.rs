//! Hostile tar layers: each unsafe entry is refused with a reason naming it, and nothing
//! is written outside the bundle directory.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use berth_bundle::{BundleLimits, ExtractError, UnsafeEntry, extract_tar};
use tar::EntryType;

/// One tar entry, written with raw names so that `..` and absolute paths get through.
struct Raw<'a> {
    name: &'a str,
    kind: EntryType,
    link: &'a str,
    data: &'a [u8],
    mode: u32,
}

fn file<'a>(name: &'a str, data: &'static [u8]) -> Raw<'a> {
    Raw { name, kind: EntryType::Regular, link: "", data, mode: 0o644 }
}

fn link(name: &'static str, kind: EntryType, target: &'static str) -> Raw<'static> {
    Raw { name, kind, link: target, data: b"", mode: 0o777 }
}

fn tar_of(entries: &[Raw<'_>]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for entry in entries {
        let mut header = tar::Header::new_old();
        let old = header.as_old_mut();
        old.name[..entry.name.len()].copy_from_slice(entry.name.as_bytes());
        old.linkname[..entry.link.len()].copy_from_slice(entry.link.as_bytes());
        header.set_entry_type(entry.kind);
        header.set_size(entry.data.len() as u64);
        header.set_mode(entry.mode);
        header.set_cksum();
        builder.append(&header, entry.data).unwrap();
    }
    builder.into_inner().unwrap()
}

/// A parent directory holding a sentinel file and the (empty) bundle directory.
struct Scene {
    parent: tempfile::TempDir,
}

impl Scene {
    fn new() -> Self {
        let parent = tempfile::tempdir().unwrap();
        std::fs::write(parent.path().join("outside"), "untouched").unwrap();
        std::fs::create_dir(parent.path().join("bundle")).unwrap();
        Self { parent }
    }

    fn bundle(&self) -> std::path::PathBuf {
        self.parent.path().join("bundle")
    }

    /// The parent's contents, the bundle directory left out.
    fn outside(&self) -> Vec<(String, String, u64)> {
        common::names(self.parent.path())
            .into_iter()
            .filter(|name| name != "bundle")
            .map(|name| {
                let path = self.parent.path().join(&name);
                let meta = std::fs::symlink_metadata(&path).unwrap();
                let content = if meta.is_file() { std::fs::read_to_string(&path).unwrap() } else { String::new() };
                (name, content, meta.nlink())
            })
            .collect()
    }

    /// Extracts `tar` and returns the refusal, checking nothing outside changed.
    fn refuse(&self, tar: &[u8], limits: &BundleLimits) -> (String, UnsafeEntry) {
        let before = self.outside();
        let result = extract_tar(tar, &self.bundle(), limits);
        assert_eq!(self.outside(), before, "something outside the bundle changed");
        match result {
            Err(ExtractError::Refused { entry, reason }) => (entry, reason),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
}

fn refused(entries: &[Raw<'_>]) -> (String, UnsafeEntry) {
    Scene::new().refuse(&tar_of(entries), &BundleLimits::default())
}

#[test]
fn parent_dir_paths_are_refused() {
    let (entry, reason) = refused(&[file("ok", b"1"), file("../outside", b"overwritten")]);
    assert_eq!((entry.as_str(), reason), ("../outside", UnsafeEntry::ParentDir));
    let (entry, reason) = refused(&[file("a/../../x", b"x")]);
    assert_eq!((entry.as_str(), reason), ("a/../../x", UnsafeEntry::ParentDir));
}

#[test]
fn absolute_paths_are_refused() {
    let scene = Scene::new();
    let target = scene.parent.path().join("outside");
    let name = target.to_str().unwrap();
    let (entry, reason) = scene.refuse(&tar_of(&[file(name, b"overwritten")]), &BundleLimits::default());
    assert_eq!((entry.as_str(), reason), (name, UnsafeEntry::AbsolutePath));
    let (entry, reason) = refused(&[file("/etc/x", b"x")]);
    assert_eq!((entry.as_str(), reason), ("/etc/x", UnsafeEntry::AbsolutePath));
}

#[test]
fn symlinks_out_of_the_bundle_are_refused() {
    let (entry, reason) = refused(&[link("passwd", EntryType::Symlink, "/etc/passwd")]);
    assert_eq!((entry.as_str(), reason), ("passwd", UnsafeEntry::AbsoluteSymlink("/etc/passwd".into())));

    let (entry, reason) = refused(&[link("a/up", EntryType::Symlink, "../../x")]);
    assert_eq!((entry.as_str(), reason), ("a/up", UnsafeEntry::SymlinkEscapes("../../x".into())));

    let (entry, reason) = refused(&[link("up", EntryType::Symlink, "..")]);
    assert_eq!((entry.as_str(), reason), ("up", UnsafeEntry::SymlinkEscapes("..".into())));
}

#[test]
fn symlinks_that_escape_through_other_symlinks_are_refused() {
    // `d/b` points at the bundle root, which is fine; `a` looks inside when read as
    // text (`d/b/..` is `d`) but the kernel follows `d/b` first and lands outside.
    let (entry, reason) =
        refused(&[link("d/b", EntryType::Symlink, ".."), link("a", EntryType::Symlink, "d/b/../outside")]);
    assert_eq!((entry.as_str(), reason), ("a", UnsafeEntry::SymlinkEscapes("d/b/../outside".into())));

    let (entry, reason) =
        refused(&[link("loop1", EntryType::Symlink, "loop2"), link("loop2", EntryType::Symlink, "loop1")]);
    assert_eq!((entry.as_str(), reason), ("loop1", UnsafeEntry::SymlinkLoop));
}

#[test]
fn entries_written_through_a_symlink_are_refused() {
    let (entry, reason) = refused(&[
        Raw { name: "sub/", kind: EntryType::Directory, link: "", data: b"", mode: 0o755 },
        link("s", EntryType::Symlink, "sub"),
        file("s/f", b"x"),
    ]);
    assert_eq!((entry.as_str(), reason), ("s/f", UnsafeEntry::ThroughSymlink("s".into())));
}

#[test]
fn hardlinks_out_of_the_bundle_are_refused() {
    let (entry, reason) = refused(&[link("hard", EntryType::Link, "../outside")]);
    assert_eq!((entry.as_str(), reason), ("hard", UnsafeEntry::HardlinkEscapes("../outside".into())));

    let (entry, reason) = refused(&[link("hard", EntryType::Link, "/etc/passwd")]);
    assert_eq!((entry.as_str(), reason), ("hard", UnsafeEntry::HardlinkEscapes("/etc/passwd".into())));

    // To nothing extracted before it.
    let (entry, reason) = refused(&[link("hard", EntryType::Link, "missing")]);
    assert_eq!((entry.as_str(), reason), ("hard", UnsafeEntry::HardlinkEscapes("missing".into())));
}

#[test]
fn device_files_and_fifos_are_refused() {
    let (entry, reason) = refused(&[file("ok", b"1"), link("null", EntryType::Char, "")]);
    assert_eq!((entry.as_str(), reason), ("null", UnsafeEntry::DeviceFile));
    let (entry, reason) = refused(&[link("disk", EntryType::Block, "")]);
    assert_eq!((entry.as_str(), reason), ("disk", UnsafeEntry::DeviceFile));
    let (entry, reason) = refused(&[link("pipe", EntryType::Fifo, "")]);
    assert_eq!((entry.as_str(), reason), ("pipe", UnsafeEntry::Fifo));
}

#[test]
fn oversized_entries_and_bundles_are_refused() {
    let limits = BundleLimits { max_total_bytes: 2500, max_file_bytes: 1024, max_entries: 3 };
    let big = [7u8; 2048];
    let (entry, reason) = Scene::new().refuse(&tar_of(&[Raw { data: &big, ..file("big.bin", b"") }]), &limits);
    assert_eq!((entry.as_str(), reason), ("big.bin", UnsafeEntry::FileTooLarge { size: 2048, limit: 1024 }));

    let kilo = [1u8; 1000];
    let three = [
        Raw { data: &kilo, ..file("one", b"") },
        Raw { data: &kilo, ..file("two", b"") },
        Raw { data: &kilo, ..file("three", b"") },
    ];
    let (entry, reason) = Scene::new().refuse(&tar_of(&three), &limits);
    assert_eq!((entry.as_str(), reason), ("three", UnsafeEntry::BundleTooLarge { limit: 2500 }));

    let four = [file("1", b"1"), file("2", b"2"), file("3", b"3"), file("4", b"4")];
    let (entry, reason) = Scene::new().refuse(&tar_of(&four), &limits);
    assert_eq!((entry.as_str(), reason), ("4", UnsafeEntry::TooManyEntries { limit: 3 }));
}

#[test]
fn duplicate_entries_are_refused() {
    let (entry, reason) = refused(&[file("f", b"first"), file("f", b"second")]);
    assert_eq!((entry.as_str(), reason), ("f", UnsafeEntry::Duplicate));
}

#[test]
fn a_safe_layer_extracts_with_sane_modes() {
    let scene = Scene::new();
    let tar = tar_of(&[
        Raw { name: "./", kind: EntryType::Directory, link: "", data: b"", mode: 0o700 },
        Raw { name: "bin/", kind: EntryType::Directory, link: "", data: b"", mode: 0o777 },
        Raw { name: "bin/app", kind: EntryType::Regular, link: "", data: b"#!/bin/sh\n", mode: 0o4777 },
        Raw { name: "etc/conf", kind: EntryType::Regular, link: "", data: b"a=1", mode: 0o666 },
        link("etc/current", EntryType::Symlink, "conf"),
        link("app", EntryType::Symlink, "bin/../bin/app"),
        link("conf-copy", EntryType::Link, "etc/conf"),
    ]);
    let stats = extract_tar(&tar[..], &scene.bundle(), &BundleLimits::default()).unwrap();
    assert_eq!(stats.files, 2);
    let root = scene.bundle();
    let mode = |p: &str| std::fs::symlink_metadata(root.join(p)).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode("bin"), 0o755);
    assert_eq!(mode("bin/app"), 0o755);
    assert_eq!(mode("etc/conf"), 0o644);
    assert_eq!(std::fs::read_to_string(root.join("etc/current")).unwrap(), "a=1");
    assert_eq!(std::fs::read_to_string(root.join("conf-copy")).unwrap(), "a=1");
    assert_eq!(std::fs::read_link(root.join("app")).unwrap(), Path::new("bin/../bin/app"));
    assert_eq!(scene.outside(), [("outside".to_owned(), "untouched".to_owned(), 1)]);
}

#[test]
fn a_corrupt_archive_is_an_archive_error() {
    let scene = Scene::new();
    let mut tar = tar_of(&[file("f", b"content")]);
    tar[148] ^= 0x7f; // the header checksum
    let result = extract_tar(&tar[..], &scene.bundle(), &BundleLimits::default());
    assert!(matches!(result, Err(ExtractError::Archive(_))), "{result:?}");
}
