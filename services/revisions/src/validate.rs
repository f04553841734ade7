//! Checks on what callers send, before anything is read or written. An
//! apply is checked whole: every bad field is named in one
//! `INVALID_ARGUMENT`, with what it must be instead.

use std::collections::HashSet;

use berth_bundle::BundleReference;
use berth_core::image_settings_problems;
use berth_proto::revisions::v1::{AckRoutesRequest, ApplyServiceRequest, ServiceTemplate, Source};
use berth_proto::types::v1::BundleRef;
use berth_rpc::invalid::{Checker, Invalid, shown};

use crate::model::{DEFAULT_PROJECT, ServiceKey, fingerprint};
use crate::resolver::RegistryPolicy;

/// The longest service name: a revision name (`<service>-NNNNN`) is then
/// still a DNS label.
pub(crate) const MAX_SERVICE_NAME: usize = 57;
/// Most replicas one service may ask for.
pub(crate) const MAX_REPLICAS: u32 = 1000;
/// The longest command or argument.
const MAX_ARG_BYTES: usize = 4096;
/// Most arguments.
const MAX_ARGS: usize = 256;
/// Most environment variables.
const MAX_ENV: usize = 256;
/// The longest environment variable name.
const MAX_ENV_NAME: usize = 256;
/// The longest environment variable value.
const MAX_ENV_VALUE: usize = 32 << 10;
/// Most ports.
const MAX_PORTS: usize = 32;
/// The longest bundle reference.
const MAX_REFERENCE: usize = 1024;
/// The longest secret name.
const MAX_SECRET: usize = 253;
/// The longest source repository, ref or label value.
const MAX_SOURCE_TEXT: usize = 2048;
/// Most source labels.
const MAX_LABELS: usize = 64;
/// The longest source label name.
const MAX_LABEL_NAME: usize = 253;
/// The longest wait between readiness checks.
const MAX_READINESS_PERIOD_MILLIS: u32 = 60_000;
/// The longest revision name a caller may name.
const MAX_REVISION_NAME: usize = 128;

/// Most acknowledgements one `AckRoutes` carries.
pub(crate) const MAX_ROUTE_ACKS: usize = 10_000;
/// The longest router instance name (a host name).
const MAX_INSTANCE: usize = 253;

/// A checked `ApplyService`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ValidApply {
    pub(crate) key: ServiceKey,
    pub(crate) template: ServiceTemplate,
    pub(crate) source: Source,
    pub(crate) fingerprint: String,
}

/// `project`, or the default project when empty.
pub(crate) fn project(project: &str) -> Result<String, Invalid> {
    if project.is_empty() {
        return Ok(DEFAULT_PROJECT.to_owned());
    }
    let mut check = Checker::default();
    check.dns_label("project", project, "a project name");
    check.finish().map(|()| project.to_owned())
}

/// A service key from a request's project and name fields.
pub(crate) fn service_key(project_field: &str, name: &str, name_field: &str) -> Result<ServiceKey, Invalid> {
    let mut check = Checker::default();
    let project = if project_field.is_empty() { DEFAULT_PROJECT } else { project_field };
    if !project_field.is_empty() {
        check.dns_label("project", project_field, "a project name");
    }
    service_name(&mut check, name_field, name);
    check.finish().map(|()| ServiceKey::new(project, name))
}

fn service_name(check: &mut Checker, field: &str, name: &str) {
    if name.is_empty() {
        check.bad(field, "must not be empty");
    } else if name.len() > MAX_SERVICE_NAME {
        check.bad(field, format!("must be at most {MAX_SERVICE_NAME} characters"));
    } else {
        check.dns_label(field, name, "a service name");
    }
}

/// A checked `AckRoutes`: the instance, and each service's generation.
pub(crate) fn route_acks(request: &AckRoutesRequest) -> Result<Vec<(ServiceKey, i64)>, Invalid> {
    let mut check = Checker::default();
    if request.instance.len() > MAX_INSTANCE
        || !request.instance.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
    {
        check.bad(
            "instance",
            format!(
                "'{}' is not a host name (at most {MAX_INSTANCE} of a-z, 0-9, '-', '.', '_')",
                shown(&request.instance)
            ),
        );
    }
    if request.acks.len() > MAX_ROUTE_ACKS {
        check.bad("acks", format!("{} acknowledgements; at most {MAX_ROUTE_ACKS} at once", request.acks.len()));
        return check.finish().map(|()| Vec::new());
    }
    let mut acks = Vec::with_capacity(request.acks.len());
    for (n, ack) in request.acks.iter().enumerate() {
        let project = if ack.project.is_empty() { DEFAULT_PROJECT } else { ack.project.as_str() };
        if !ack.project.is_empty() {
            check.dns_label(&format!("acks[{n}].project"), &ack.project, "a project name");
        }
        service_name(&mut check, &format!("acks[{n}].service"), &ack.service);
        match i64::try_from(ack.generation) {
            Ok(generation) => acks.push((ServiceKey::new(project, &ack.service), generation)),
            Err(_) => check.bad(format!("acks[{n}].generation"), "is larger than any route generation"),
        }
    }
    check.finish().map(|()| acks)
}

/// A revision name a caller gives: empty allowed when `optional`.
pub(crate) fn revision_name(field: &str, name: &str, optional: bool) -> Result<(), Invalid> {
    let mut check = Checker::default();
    if name.is_empty() {
        if !optional {
            check.bad(field, "must not be empty");
        }
    } else if name.len() > MAX_REVISION_NAME || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
        check.bad(field, format!("'{}' is not a revision name (<service>-<generation>)", shown(name)));
    }
    check.finish()
}

/// Checks a whole `ApplyService` against `policy`.
pub(crate) fn apply(request: ApplyServiceRequest, policy: &RegistryPolicy) -> Result<ValidApply, Invalid> {
    let mut check = Checker::default();
    let project = if request.project.is_empty() { DEFAULT_PROJECT.to_owned() } else { request.project.clone() };
    if !request.project.is_empty() {
        check.dns_label("project", &request.project, "a project name");
    }
    service_name(&mut check, "name", &request.name);
    match &request.template {
        Some(template) => self::template(&mut check, template, policy),
        None => check.bad("template", "must be set"),
    }
    let source = request.source.unwrap_or_default();
    self::source(&mut check, &source);
    check.finish()?;
    let template = request.template.unwrap_or_default();
    let fingerprint = fingerprint(&template, &source);
    Ok(ValidApply { key: ServiceKey::new(project, request.name), template, source, fingerprint })
}

/// Checks the reference of a template's bundle or image, named `field`.
fn artifact(check: &mut Checker, field: &str, bundle: &BundleRef, policy: &RegistryPolicy) {
    match BundleReference::parse(&bundle.reference) {
        _ if bundle.reference.is_empty() => check.bad(format!("{field}.reference"), "must not be empty"),
        _ if bundle.reference.len() > MAX_REFERENCE => {
            check.bad(format!("{field}.reference"), format!("must be at most {MAX_REFERENCE} bytes"));
        }
        Err(error) => check.bad(format!("{field}.reference"), error.to_string()),
        Ok(BundleReference::Layout(_)) if policy.allow_layouts => {}
        Ok(BundleReference::Layout(_)) => check.bad(
            format!("{field}.reference"),
            "must name a registry (host/repo:tag): an oci: layout directory exists on one machine only \
             (allowed with --allow-oci-layouts when every node shares it)",
        ),
        Ok(BundleReference::Registry(registry)) => {
            if bundle.insecure && !policy.plain_http(registry.registry()) {
                check.bad(
                    format!("{field}.insecure"),
                    format!(
                        "registry {} is not loopback nor among the operator's insecure registries",
                        registry.registry()
                    ),
                );
            }
            check.text(&format!("{field}.secret"), &bundle.secret, MAX_SECRET);
        }
    }
}

fn template(check: &mut Checker, template: &ServiceTemplate, policy: &RegistryPolicy) {
    if template.bundle.is_some() && template.image.is_some() {
        check.bad("template.image", "set either template.bundle or template.image, not both");
    }
    match template.artifact() {
        None => check.bad("template.bundle", "must be set (or template.image, to run a container image)"),
        Some(artifact) => {
            self::artifact(check, &format!("template.{}", artifact.kind.field()), artifact.reference, policy)
        }
    }
    if berth_proto::types::v1::RuntimeClass::try_from(template.runtime).is_err() {
        check.bad("template.runtime", format!("{} is not a RuntimeClass value", template.runtime));
    }
    let image = template.image.is_some();
    for (field, problem) in image_settings_problems(&template.working_dir, &template.user, image) {
        check.bad(format!("template.{field}"), problem);
    }
    if template.command.contains('\0') || template.command.len() > MAX_ARG_BYTES {
        check.bad("template.command", format!("must be at most {MAX_ARG_BYTES} bytes without NUL"));
    }
    if template.args.len() > MAX_ARGS {
        check.bad("template.args", format!("at most {MAX_ARGS} arguments"));
    }
    if let Some(n) = template.args.iter().position(|a| a.contains('\0') || a.len() > MAX_ARG_BYTES) {
        check.bad(format!("template.args[{n}]"), format!("must be at most {MAX_ARG_BYTES} bytes without NUL"));
    }
    if template.env.len() > MAX_ENV {
        check.bad("template.env", format!("at most {MAX_ENV} variables"));
    }
    let mut names: Vec<&String> = template.env.keys().collect();
    names.sort();
    for name in names {
        let valid_name = !name.is_empty()
            && name.len() <= MAX_ENV_NAME
            && !name.contains('=')
            && !name.chars().any(char::is_control);
        if !valid_name {
            check.bad(
                "template.env",
                format!(
                    "'{}' is not a variable name: 1-{MAX_ENV_NAME} bytes, no '=' or control characters",
                    shown(name)
                ),
            );
        } else if template.env[name].contains('\0') || template.env[name].len() > MAX_ENV_VALUE {
            check.bad(format!("template.env.{name}"), format!("must be at most {MAX_ENV_VALUE} bytes without NUL"));
        }
    }
    if let Some(resources) = template.resources {
        if resources.cpu_millis == 0 || i64::try_from(resources.cpu_millis).is_err() {
            check.bad("template.resources.cpu_millis", "must be above zero (leave resources unset for the default)");
        }
        if resources.memory_bytes == 0 || i64::try_from(resources.memory_bytes).is_err() {
            check.bad("template.resources.memory_bytes", "must be above zero (leave resources unset for the default)");
        }
    }
    let mounts = template.cache.iter().map(|mount| (mount.key.as_str(), mount.path.as_str()));
    if let Some(problem) = berth_core::cache_mounts_problem(mounts) {
        check.bad("template.cache", problem);
    }
    if template.replicas.is_some_and(|r| r > MAX_REPLICAS) {
        check.bad("template.replicas", format!("must be at most {MAX_REPLICAS}"));
    }
    if template.ports.len() > MAX_PORTS {
        check.bad("template.ports", format!("at most {MAX_PORTS} ports"));
    }
    let (mut port_names, mut numbers) = (HashSet::new(), HashSet::new());
    for (n, port) in template.ports.iter().enumerate() {
        if !berth_core::is_dns_label(&port.name) {
            check.bad(format!("template.ports[{n}].name"), "must be a DNS label (lowercase letters, digits, '-')");
        } else if !port_names.insert(port.name.as_str()) {
            check.bad(format!("template.ports[{n}].name"), format!("'{}' is named twice", port.name));
        }
        if port.port == 0 || port.port > 65535 {
            check.bad(format!("template.ports[{n}].port"), "must be between 1 and 65535");
        } else if !numbers.insert(port.port) {
            check.bad(format!("template.ports[{n}].port"), format!("{} is listed twice", port.port));
        }
    }
    if let Some(readiness) = &template.readiness {
        if template.ports.is_empty() {
            check.bad("template.readiness", "needs a port to check: the template has none");
        } else if !readiness.port.is_empty() && !port_names.contains(readiness.port.as_str()) {
            check.bad(
                "template.readiness.port",
                format!("'{}' names none of the template's ports", shown(&readiness.port)),
            );
        }
        let path = &readiness.http_path;
        if !path.is_empty()
            && (!path.starts_with('/') || path.len() > MAX_SOURCE_TEXT || path.bytes().any(|b| b <= b' ' || b == 0x7f))
        {
            check.bad("template.readiness.http_path", "must be a path starting with '/', with no spaces");
        }
        if readiness.period_millis > MAX_READINESS_PERIOD_MILLIS {
            check.bad(
                "template.readiness.period_millis",
                format!("must be at most {MAX_READINESS_PERIOD_MILLIS} (a minute)"),
            );
        }
    }
    if let Some(egress) = &template.egress
        && !egress.gateway.is_empty()
    {
        check.dns_label("template.egress.gateway", &egress.gateway, "a gateway name");
    }
    if !template.tier.is_empty() {
        check.dns_label("template.tier", &template.tier, "a tier name");
    }
}

fn source(check: &mut Checker, source: &Source) {
    check.text("source.repo", &source.repo, MAX_SOURCE_TEXT);
    check.text("source.commit", &source.commit, 256);
    check.text("source.ref", &source.r#ref, MAX_SOURCE_TEXT);
    if source.labels.len() > MAX_LABELS {
        check.bad("source.labels", format!("at most {MAX_LABELS} labels"));
    }
    let mut names: Vec<&String> = source.labels.keys().collect();
    names.sort();
    for name in names {
        if name.is_empty() || name.len() > MAX_LABEL_NAME || name.chars().any(char::is_control) {
            check.bad(
                "source.labels",
                format!("'{}' is not a label name: 1-{MAX_LABEL_NAME} printable bytes", shown(name)),
            );
        } else {
            check.text(&format!("source.labels.{name}"), &source.labels[name], MAX_SOURCE_TEXT);
        }
    }
}

#[cfg(test)]
mod tests {
    use berth_proto::revisions::v1::EgressSelection;
    use berth_proto::types::v1::{BundleRef, Capacity, Port, Readiness};

    use super::*;

    fn request() -> ApplyServiceRequest {
        ApplyServiceRequest {
            project: String::new(),
            name: "web".into(),
            template: Some(ServiceTemplate {
                bundle: Some(BundleRef { reference: "registry.example.com/team/web:v1".into(), ..Default::default() }),
                ports: vec![Port { name: "http".into(), port: 8080 }],
                ..Default::default()
            }),
            source: None,
        }
    }

    fn fields(request: ApplyServiceRequest) -> Vec<String> {
        apply(request, &RegistryPolicy::default()).unwrap_err().fields().into_iter().map(str::to_owned).collect()
    }

    #[test]
    fn a_good_apply_lands_in_the_default_project() {
        let valid = apply(request(), &RegistryPolicy::default()).unwrap();
        assert_eq!(valid.key, ServiceKey::new("default", "web"));
    }

    #[test]
    fn each_bad_field_is_named() {
        type Spoil = Box<dyn Fn(&mut ApplyServiceRequest)>;
        fn template(r: &mut ApplyServiceRequest) -> &mut ServiceTemplate {
            r.template.as_mut().unwrap()
        }
        let cases: Vec<(&str, Spoil)> = vec![
            ("project", Box::new(|r| r.project = "Team_A".into())),
            ("name", Box::new(|r| r.name.clear())),
            ("name", Box::new(|r| r.name = "Web".into())),
            ("name", Box::new(|r| r.name = "w".repeat(58))),
            ("template", Box::new(|r| r.template = None)),
            ("template.bundle", Box::new(|r| template(r).bundle = None)),
            ("template.bundle.reference", Box::new(|r| template(r).bundle.as_mut().unwrap().reference.clear())),
            (
                "template.bundle.reference",
                Box::new(|r| template(r).bundle.as_mut().unwrap().reference = "oci:/tmp/layout:v1".into()),
            ),
            (
                "template.bundle.reference",
                Box::new(|r| template(r).bundle.as_mut().unwrap().reference = "registry.example.com/Web:v1".into()),
            ),
            ("template.bundle.insecure", Box::new(|r| template(r).bundle.as_mut().unwrap().insecure = true)),
            ("template.command", Box::new(|r| template(r).command = "a\0b".into())),
            ("template.args[1]", Box::new(|r| template(r).args = vec!["ok".into(), "x".repeat(5000)])),
            ("template.env", Box::new(|r| _ = template(r).env.insert("A=B".into(), "1".into()))),
            (
                "template.resources.cpu_millis",
                Box::new(|r| template(r).resources = Some(Capacity { cpu_millis: 0, memory_bytes: 1 })),
            ),
            ("template.replicas", Box::new(|r| template(r).replicas = Some(MAX_REPLICAS + 1))),
            ("template.ports[0].name", Box::new(|r| template(r).ports[0].name = "HTTP".into())),
            ("template.ports[0].port", Box::new(|r| template(r).ports[0].port = 70000)),
            ("template.ports[1].port", Box::new(|r| template(r).ports.push(Port { name: "alt".into(), port: 8080 }))),
            (
                "template.egress.gateway",
                Box::new(|r| {
                    template(r).egress = Some(EgressSelection { gateway: "Main".into(), disabled: false });
                }),
            ),
            ("template.tier", Box::new(|r| template(r).tier = "GPU".into())),
            ("template.working_dir", Box::new(|r| template(r).working_dir = "/srv".into())),
            ("template.user", Box::new(|r| template(r).user = "app".into())),
            (
                "template.user",
                Box::new(|r| {
                    let t = template(r);
                    (t.image, t.user) = (t.bundle.take(), "app:".into());
                }),
            ),
            (
                "template.working_dir",
                Box::new(|r| {
                    let t = template(r);
                    (t.image, t.working_dir) = (t.bundle.take(), "srv".into());
                }),
            ),
            (
                "template.readiness.port",
                Box::new(|r| template(r).readiness = Some(Readiness { port: "admin".into(), ..Default::default() })),
            ),
            (
                "template.readiness.http_path",
                Box::new(|r| {
                    template(r).readiness = Some(Readiness { http_path: "healthz".into(), ..Default::default() });
                }),
            ),
            (
                "template.readiness.period_millis",
                Box::new(|r| template(r).readiness = Some(Readiness { period_millis: 600_000, ..Default::default() })),
            ),
            (
                "template.readiness",
                Box::new(|r| {
                    template(r).ports.clear();
                    template(r).readiness = Some(Readiness::default());
                }),
            ),
            ("source.repo", Box::new(|r| r.source = Some(Source { repo: "a\nb".into(), ..Default::default() }))),
        ];
        for (field, spoil) in cases {
            let mut bad = request();
            spoil(&mut bad);
            assert_eq!(fields(bad), [field], "{field}");
        }
    }

    #[test]
    fn every_bad_field_is_named_at_once() {
        let mut bad = request();
        bad.name = "Web".into();
        bad.template.as_mut().unwrap().replicas = Some(MAX_REPLICAS + 1);
        bad.template.as_mut().unwrap().tier = "GPU".into();
        let error = apply(bad, &RegistryPolicy::default()).unwrap_err();
        assert_eq!(error.fields(), ["name", "template.replicas", "template.tier"]);
        let status = tonic::Status::from(error);
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(status.message().contains("name: 'Web' is not a service name"), "{}", status.message());
    }

    #[test]
    fn plain_http_is_allowed_to_loopback_and_listed_registries() {
        let mut loopback = request();
        let bundle = loopback.template.as_mut().unwrap().bundle.as_mut().unwrap();
        bundle.reference = "127.0.0.1:5000/team/web:v1".into();
        bundle.insecure = true;
        assert!(apply(loopback, &RegistryPolicy::default()).is_ok());
        let mut listed = request();
        listed.template.as_mut().unwrap().bundle.as_mut().unwrap().insecure = true;
        let policy =
            RegistryPolicy { insecure_registries: vec!["registry.example.com".into()], ..RegistryPolicy::default() };
        assert!(apply(listed, &policy).is_ok());
    }

    #[test]
    fn revision_names_are_checked() {
        assert!(revision_name("pinned_revision", "", true).is_ok());
        assert!(revision_name("name", "", false).is_err());
        assert!(revision_name("name", "web-00001", false).is_ok());
        assert!(revision_name("name", "web/00001", false).is_err());
    }
}
