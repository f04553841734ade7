//! What a template or lease may say about the container image it runs, in
//! one place, so that every service that accepts such a value (revisions,
//! leases, the node that resolves it) accepts the same ones.

/// The longest image user a template or lease may name.
pub const MAX_IMAGE_USER: usize = 256;

/// The longest working directory a template or lease may name.
pub const MAX_WORKING_DIR: usize = 4096;

/// Why `user` cannot name an image's user, as a config's `User` does
/// (`name`, `uid`, `name:group` or `uid:gid`); `None` when it can.
pub fn image_user_problem(user: &str) -> Option<String> {
    if user.len() > MAX_IMAGE_USER {
        return Some(format!("must be at most {MAX_IMAGE_USER} bytes"));
    }
    let (name, group) = match user.split_once(':') {
        Some((name, group)) => (name, Some(group)),
        None => (user, None),
    };
    let bad = |part: &str| part.is_empty() || part.contains([':', '\0', '/']) || part.chars().any(char::is_whitespace);
    if bad(name) || group.is_some_and(bad) {
        return Some(format!("`{user}` is not user, uid, user:group or uid:gid"));
    }
    None
}

/// Why `dir` cannot be a working directory inside an image; `None` when it can.
pub fn working_dir_problem(dir: &str) -> Option<String> {
    if dir.len() > MAX_WORKING_DIR || dir.contains('\0') {
        return Some(format!("must be at most {MAX_WORKING_DIR} bytes without NUL"));
    }
    if !dir.starts_with('/') {
        return Some(format!("`{dir}` is not an absolute path"));
    }
    None
}

/// What is wrong with the `working_dir` and `user` a template or lease sets
/// in place of its image's: each field named (`working_dir`, `user`) with
/// its problem. Empty values are fine; a set one needs `image` (the
/// template or lease runs a container image).
pub fn image_settings_problems(working_dir: &str, user: &str, image: bool) -> Vec<(&'static str, String)> {
    [
        ("working_dir", working_dir, working_dir_problem as fn(&str) -> Option<String>),
        ("user", user, image_user_problem),
    ]
    .into_iter()
    .filter(|(_, value, _)| !value.is_empty())
    .filter_map(|(field, value, check)| {
        check(value)
            .or_else(|| (!image).then(|| "applies only to a container image".to_owned()))
            .map(|problem| (field, problem))
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_are_names_or_ids_with_an_optional_group() {
        for good in ["app", "1000", "app:staff", "1000:50", "www-data"] {
            assert_eq!(image_user_problem(good), None, "{good}");
        }
        for bad in ["", ":", "app:", ":staff", "a:b:c", "two words", "a\0b", "../x", &"u".repeat(300)] {
            assert!(image_user_problem(bad).is_some(), "{bad:?}");
        }
    }

    #[test]
    fn settings_are_checked_only_when_set_and_only_for_an_image() {
        assert!(image_settings_problems("", "", false).is_empty());
        assert!(image_settings_problems("/srv", "app", true).is_empty());
        let fields: Vec<&str> = image_settings_problems("srv", "app", false).into_iter().map(|(f, _)| f).collect();
        assert_eq!(fields, ["working_dir", "user"]);
        assert!(image_settings_problems("", "app", false)[0].1.contains("only to a container image"));
    }

    #[test]
    fn working_directories_are_absolute() {
        assert_eq!(working_dir_problem("/srv/app"), None);
        assert!(working_dir_problem("srv").unwrap().contains("not an absolute path"));
        assert!(working_dir_problem("/a\0").is_some());
    }
}
