//! An image's `User`: the account inside the image its workload is, and
//! what the image gives that account.
//!
//! A contained workload always runs as a host uid of its own, never root and
//! never shared with another workload, whatever its image says. So an
//! image's `User` is not a host uid: it names the account inside the image
//! whose files, name and home the workload takes on. At launch the provider
//! gives the lease's own uid and gid, in the lease's copy-on-write view only,
//! what the image's layers gave that user (as owner) or its group, and names
//! the lease's ids after the account in the view's `/etc/passwd` and
//! `/etc/group`; so `id`, `whoami` and `ls -l` show the image's user, the
//! workload can write what the image meant it to write, and `HOME` is the
//! account's home. Nothing of the shared unpacked root changes.
//!
//! # Resolved once per image
//! When the image is unpacked (its root never changes after): the layers'
//! owners are noted entry by entry ([`ImageOwners`]: later layers replace,
//! whiteouts and opaque directories forget), and once every layer is in,
//! `User` is looked up in the root's `/etc/passwd` and `/etc/group`
//! ([`ImageUser::resolve`]). The cache keeps the owners beside the root, so
//! a lease that names another user than the config's is resolved the same
//! way at launch.
//!
//! # What `User` may be
//! `user`, `uid`, `user:group` or `uid:gid`, as Docker reads it. A name the
//! image's `/etc/passwd` (or `/etc/group`) does not have is refused, naming
//! it; so is an id that is not a number. A uid the image's `/etc/passwd`
//! does not list is taken as it is, with gid 0 unless one is given.
//! Empty, `root`, or uid 0 gives nothing: such a workload runs as its own
//! uid and the image's files stay root's (readable, not writable), as for
//! every image.
//!
//! # Invariants
//! - Every path in [`ImageUser::owned`] is relative, has no `..` and
//!   reaches an entry of the root through directories only (no symlink on
//!   the way), as it was when resolved; the provider still opens each one
//!   beneath the lease's root refusing symlinks, so a path can never lead out.
//! - `/etc/passwd` and `/etc/group` are read only as regular files reached
//!   through directories, never through a link.

use std::collections::BTreeMap;
use std::fs;
use std::io::Read as _;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The most of `/etc/passwd` or `/etc/group` read.
const MAX_ACCOUNTS_FILE_BYTES: u64 = 1 << 20;

/// Who the layers of an image say owns each entry, where that is not root.
/// Kept as a list of `[path, uid, gid]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "Vec<(PathBuf, u32, u32)>", into = "Vec<(PathBuf, u32, u32)>")]
pub struct ImageOwners {
    owners: BTreeMap<PathBuf, (u32, u32)>,
}

impl From<Vec<(PathBuf, u32, u32)>> for ImageOwners {
    fn from(list: Vec<(PathBuf, u32, u32)>) -> Self {
        Self { owners: list.into_iter().map(|(path, uid, gid)| (path, (uid, gid))).collect() }
    }
}

impl From<ImageOwners> for Vec<(PathBuf, u32, u32)> {
    fn from(owners: ImageOwners) -> Self {
        owners.owners.into_iter().map(|(path, (uid, gid))| (path, uid, gid)).collect()
    }
}

impl ImageOwners {
    /// A layer wrote `rel` owned by `uid`:`gid`; ids past 32 bits are taken
    /// as root, and so is an entry whose path is not UTF-8 (it cannot be
    /// kept, so no user is given it).
    pub(crate) fn note(&mut self, rel: &Path, uid: u64, gid: u64) {
        let (uid, gid) = (u32::try_from(uid).unwrap_or(0), u32::try_from(gid).unwrap_or(0));
        if (uid, gid) == (0, 0) || rel.to_str().is_none() {
            self.owners.remove(rel);
        } else {
            self.owners.insert(rel.to_path_buf(), (uid, gid));
        }
    }

    /// `rel` and everything under it are gone.
    pub(crate) fn forget(&mut self, rel: &Path) {
        // Paths order by component, so what is under `rel` follows it at once.
        let gone: Vec<PathBuf> = self
            .owners
            .range(rel.to_path_buf()..)
            .map(|(path, _)| path)
            .take_while(|p| p.starts_with(rel))
            .cloned()
            .collect();
        for path in gone {
            self.owners.remove(&path);
        }
    }

    /// How many entries are noted.
    pub fn len(&self) -> usize {
        self.owners.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.owners.is_empty()
    }
}

/// What an image gives its `User`, to be given to a lease's own ids.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageUser {
    /// The account's name in the image's `/etc/passwd`, when it has one.
    pub name: Option<String>,
    /// The uid inside the image.
    pub uid: u32,
    /// The gid inside the image (0 when neither `User` nor the account gives one).
    pub gid: u32,
    /// The group's name in the image's `/etc/group`, when it has one.
    pub group: Option<String>,
    /// The account's home, as `/etc/passwd` gives it.
    pub home: Option<String>,
    /// The entries the layers gave the uid or the gid, relative to the root.
    pub owned: Vec<OwnedPath>,
}

/// One entry of the image its user owns, or its group does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnedPath {
    /// Relative to the root.
    pub path: PathBuf,
    /// Its owner is the user.
    pub owner: bool,
    /// Its group is the user's group.
    pub group: bool,
}

/// One line of `/etc/passwd` or `/etc/group`.
struct Account<'a> {
    name: &'a str,
    id: u32,
    gid: Option<u32>,
    home: Option<&'a str>,
}

impl ImageUser {
    /// Looks up `user` (an image config's `User`) in the unpacked `root` and
    /// gathers what `owners` says is its; `None` for root. The error says
    /// what in `user` the image does not have.
    pub fn resolve(user: &str, root: &Path, owners: &ImageOwners) -> Result<Option<Self>, String> {
        let user = user.trim();
        if user.is_empty() {
            return Ok(None);
        }
        let (user_part, group_part) = match user.split_once(':') {
            Some((user_part, group_part)) => (user_part, Some(group_part)),
            None => (user, None),
        };
        if let Some(problem) = berth_core::image_user_problem(user) {
            return Err(format!("User {problem}"));
        }
        let passwd = read_in_root(root, "etc/passwd").map_err(|e| format!("User `{user}`: {e}"))?;
        let accounts: Vec<Account<'_>> = passwd.as_deref().map(|text| parse_accounts(text, true)).unwrap_or_default();
        let account = match user_part.parse::<u32>() {
            Ok(uid) => accounts.iter().find(|a| a.id == uid),
            Err(_) if is_numeric(user_part) => {
                return Err(format!("User `{user}`: uid `{user_part}` is not a 32-bit number"));
            }
            Err(_) => Some(accounts.iter().find(|a| a.name == user_part).ok_or_else(|| {
                format!("User `{user}` names `{user_part}`, whom the image's /etc/passwd does not have")
            })?),
        };
        let uid = account.map_or_else(|| user_part.parse().unwrap_or(0), |a| a.id);
        if uid == 0 {
            return Ok(None);
        }
        let groups_text = read_in_root(root, "etc/group").map_err(|e| format!("User `{user}`: {e}"))?;
        let groups: Vec<Account<'_>> =
            groups_text.as_deref().map(|text| parse_accounts(text, false)).unwrap_or_default();
        let gid = match group_part {
            None => account.and_then(|a| a.gid).unwrap_or(0),
            Some(group) => match group.parse::<u32>() {
                Ok(gid) => gid,
                Err(_) if is_numeric(group) => {
                    return Err(format!("User `{user}`: gid `{group}` is not a 32-bit number"));
                }
                Err(_) => groups.iter().find(|g| g.name == group).map(|g| g.id).ok_or_else(|| {
                    format!("User `{user}` names group `{group}`, which the image's /etc/group does not have")
                })?,
            },
        };
        let owned = owners
            .owners
            .iter()
            .filter_map(|(path, &(owner, group))| {
                let owned = OwnedPath { path: path.clone(), owner: owner == uid, group: gid != 0 && group == gid };
                (owned.owner || owned.group).then_some(owned)
            })
            .filter(|owned| reachable(root, &owned.path))
            .collect();
        Ok(Some(Self {
            name: account.map(|a| a.name.to_owned()),
            uid,
            gid,
            group: groups.iter().find(|g| g.id == gid).map(|g| g.name.to_owned()),
            home: account.and_then(|a| a.home).filter(|home| home.starts_with('/')).map(str::to_owned),
            owned,
        }))
    }
}

fn is_numeric(text: &str) -> bool {
    text.bytes().all(|b| b.is_ascii_digit())
}

/// The accounts of a `passwd` (`name:x:uid:gid:gecos:home:shell`) or
/// `group` (`name:x:gid:members`) file; lines that are neither are skipped.
fn parse_accounts(text: &str, passwd: bool) -> Vec<Account<'_>> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            let id = fields.get(2)?.parse().ok()?;
            let name = *fields.first().filter(|name| !name.is_empty())?;
            if !passwd {
                return Some(Account { name, id, gid: None, home: None });
            }
            Some(Account { name, id, gid: fields.get(3).and_then(|g| g.parse().ok()), home: fields.get(5).copied() })
        })
        .collect()
}

/// Whether `rel` names an entry of `root` reached through directories
/// only; an entry that is itself a link does not count (a link's owner
/// grants nothing).
fn reachable(root: &Path, rel: &Path) -> bool {
    if !rel.components().all(|c| matches!(c, Component::Normal(_))) {
        return false;
    }
    let mut here = root.to_path_buf();
    for part in rel.components() {
        here.push(part);
        match fs::symlink_metadata(&here) {
            Ok(meta) if meta.file_type().is_symlink() => return false,
            Ok(_) => {}
            Err(_) => return false,
        }
    }
    true
}

/// The text of the regular file `rel` in `root`, reached through
/// directories only; `None` when there is none (or a link is on the way).
fn read_in_root(root: &Path, rel: &str) -> Result<Option<String>, String> {
    let path = root.join(rel);
    if !reachable(root, Path::new(rel)) || !fs::symlink_metadata(&path).is_ok_and(|meta| meta.is_file()) {
        return Ok(None);
    }
    let file = fs::File::open(&path).map_err(|e| format!("cannot read /{rel}: {e}"))?;
    let mut bytes = Vec::new();
    file.take(MAX_ACCOUNTS_FILE_BYTES + 1).read_to_end(&mut bytes).map_err(|e| format!("cannot read /{rel}: {e}"))?;
    if bytes.len() as u64 > MAX_ACCOUNTS_FILE_BYTES {
        return Err(format!("/{rel} is larger than {MAX_ACCOUNTS_FILE_BYTES} bytes"));
    }
    Ok(Some(String::from_utf8_lossy(&bytes).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root_with(passwd: &str, group: &str) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        fs::create_dir_all(root.path().join("etc")).unwrap();
        fs::write(root.path().join("etc/passwd"), passwd).unwrap();
        fs::write(root.path().join("etc/group"), group).unwrap();
        for dir in ["home/app/.cache", "srv/shared", "opt"] {
            fs::create_dir_all(root.path().join(dir)).unwrap();
        }
        fs::write(root.path().join("home/app/.profile"), "").unwrap();
        root
    }

    const PASSWD: &str =
        "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:App:/home/app:/bin/sh\nweb:x:33:33::/var/www:\n";
    const GROUP: &str = "root:x:0:\napp:x:1000:\nstaff:x:50:app\n";

    fn owners() -> ImageOwners {
        let mut owners = ImageOwners::default();
        owners.note(Path::new("home/app"), 1000, 1000);
        owners.note(Path::new("home/app/.profile"), 1000, 1000);
        owners.note(Path::new("home/app/.cache"), 1000, 0);
        owners.note(Path::new("srv/shared"), 0, 50);
        owners.note(Path::new("opt"), 33, 33);
        owners
    }

    fn paths(user: &ImageUser) -> Vec<(String, bool, bool)> {
        user.owned.iter().map(|o| (o.path.display().to_string(), o.owner, o.group)).collect()
    }

    #[test]
    fn a_named_user_takes_its_ids_home_and_the_entries_the_layers_gave_it() {
        let root = root_with(PASSWD, GROUP);
        let user = ImageUser::resolve("app", root.path(), &owners()).unwrap().unwrap();
        assert_eq!((user.name.as_deref(), user.uid, user.gid), (Some("app"), 1000, 1000));
        assert_eq!((user.group.as_deref(), user.home.as_deref()), (Some("app"), Some("/home/app")));
        assert_eq!(
            paths(&user),
            [
                ("home/app".into(), true, true),
                ("home/app/.cache".into(), true, false),
                ("home/app/.profile".into(), true, true)
            ]
        );
        let staff = ImageUser::resolve("app:staff", root.path(), &owners()).unwrap().unwrap();
        assert_eq!((staff.gid, staff.group.as_deref()), (50, Some("staff")));
        assert_eq!(paths(&staff)[3], ("srv/shared".into(), false, true));
    }

    #[test]
    fn numeric_ids_need_no_account_and_root_gives_nothing() {
        let root = root_with(PASSWD, GROUP);
        let listed = ImageUser::resolve("33", root.path(), &owners()).unwrap().unwrap();
        assert_eq!((listed.name.as_deref(), listed.gid, listed.home.as_deref()), (Some("web"), 33, Some("/var/www")));
        assert_eq!(paths(&listed), [("opt".into(), true, true)]);
        let unlisted = ImageUser::resolve("4242:50", root.path(), &owners()).unwrap().unwrap();
        assert_eq!((&unlisted.name, unlisted.uid, unlisted.gid, &unlisted.home), (&None, 4242, 50, &None));
        assert_eq!(paths(&unlisted), [("srv/shared".into(), false, true)]);
        for root_user in ["", "root", "0", "0:1000", " root "] {
            assert_eq!(ImageUser::resolve(root_user, root.path(), &owners()).unwrap(), None, "{root_user:?}");
        }
    }

    #[test]
    fn names_the_image_lacks_are_refused_naming_them() {
        let root = root_with(PASSWD, GROUP);
        let error = ImageUser::resolve("nobody", root.path(), &owners()).unwrap_err();
        assert!(error.contains("`nobody`") && error.contains("/etc/passwd"), "{error}");
        let error = ImageUser::resolve("app:wheel", root.path(), &owners()).unwrap_err();
        assert!(error.contains("group `wheel`") && error.contains("/etc/group"), "{error}");
        let error = ImageUser::resolve("99999999999", root.path(), &owners()).unwrap_err();
        assert!(error.contains("not a 32-bit number"), "{error}");
        assert!(ImageUser::resolve("app:", root.path(), &owners()).unwrap_err().contains("is not user"));
    }

    #[test]
    fn accounts_behind_a_link_and_entries_under_one_are_not_read() {
        let root = root_with("", "");
        let host = tempfile::tempdir().unwrap();
        fs::write(host.path().join("passwd"), PASSWD).unwrap();
        fs::remove_dir_all(root.path().join("etc")).unwrap();
        std::os::unix::fs::symlink(host.path(), root.path().join("etc")).unwrap();
        assert!(ImageUser::resolve("app", root.path(), &owners()).unwrap_err().contains("does not have"));

        fs::remove_file(root.path().join("etc")).unwrap();
        fs::create_dir(root.path().join("etc")).unwrap();
        fs::write(root.path().join("etc/passwd"), PASSWD).unwrap();
        fs::remove_dir_all(root.path().join("home/app")).unwrap();
        std::os::unix::fs::symlink(host.path(), root.path().join("home/app")).unwrap();
        let user = ImageUser::resolve("app", root.path(), &owners()).unwrap().unwrap();
        assert!(user.owned.is_empty(), "{:?}", user.owned);
    }

    #[test]
    fn a_later_layer_replaces_and_a_removal_forgets_what_was_under_it() {
        let mut owners = owners();
        owners.note(Path::new("home/app/.profile"), 0, 0);
        owners.forget(Path::new("home/app"));
        owners.note(Path::new("home/appendix"), 7, 7);
        owners.forget(Path::new("home/app"));
        let left: Vec<String> = owners.owners.keys().map(|p| p.display().to_string()).collect();
        assert_eq!(left, ["home/appendix", "opt", "srv/shared"]);
    }
}
