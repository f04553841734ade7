//! A [`CompiledPlan`] as the API shows it: the plan's content, each
//! gateway's and route's status, with conditions carried over from what was
//! written before.
//!
//! # Invariants
//! - No I/O; the time comes in as an argument. A condition keeps its
//!   transition time while its status holds, so rendering the same compile
//!   against what it produced last time reproduces it byte for byte: that is
//!   how a pass tells a change from a repeat and writes nothing for a repeat.

use std::collections::HashMap;

use berth_proto::egress::v1 as proto;
use berth_proto::types::v1::{Condition, ConditionStatus};

use crate::compile::{CompiledPlan, Destination, GatewayOutcome, RouteOutcome};
use crate::model::DEFAULT_NDOTS;
use crate::model::{ACCEPTED, CONFLICTED, EGRESS_READY, READY, reason};
use crate::records::{Declared, GatewayRow, RouteRow, timestamp};

/// A pass's output, ready to compare and write.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Rendered {
    /// The plan without generation, node acks and compile time.
    pub(crate) content: proto::EgressPlan,
    /// Each gateway's new status, by name.
    pub(crate) gateways: Vec<(String, proto::GatewayStatus)>,
    /// Each route's new status, by name.
    pub(crate) routes: Vec<(String, proto::RouteStatus)>,
}

/// Renders `compiled` for `project` over the rows it was compiled from,
/// keeping transition times from the rows' statuses and `previous` content.
pub(crate) fn render(
    project: &str,
    compiled: &CompiledPlan,
    declared: &Declared,
    previous: Option<&proto::EgressPlan>,
    now_ms: i64,
) -> Rendered {
    let Declared { gateways, routes, dns } = declared;
    let previous_services: HashMap<&str, &proto::ServiceEgress> =
        previous.map(|p| p.services.iter().map(|s| (s.service.as_str(), s)).collect()).unwrap_or_default();
    let services = compiled
        .services
        .iter()
        .map(|plan| {
            let mut condition = condition(
                EGRESS_READY,
                plan.readiness.holds(),
                plan.readiness.reason(),
                plan.readiness.message(plan.gateway.as_deref()),
                0,
            );
            let before = previous_services.get(plan.service.as_str()).and_then(|s| s.condition.as_ref());
            stamp(&mut condition, before, now_ms);
            proto::ServiceEgress {
                service: plan.service.clone(),
                gateway: plan.gateway.clone().unwrap_or_default(),
                allowed: plan.destinations.allowed.iter().map(destination).collect(),
                denied: plan.destinations.denied.iter().map(destination).collect(),
                condition: Some(condition),
            }
        })
        .collect();

    let gateway_rows: HashMap<&str, &GatewayRow> = gateways.iter().map(|g| (g.name.as_str(), g)).collect();
    let mut gateway_statuses = Vec::with_capacity(compiled.gateways.len());
    let mut gateway_objects = Vec::with_capacity(compiled.gateways.len());
    for outcome in &compiled.gateways {
        let Some(row) = gateway_rows.get(outcome.name.as_str()) else { continue };
        let status = gateway_status(outcome, &row.status, now_ms);
        gateway_objects.push(row.to_proto_with(status.clone()));
        gateway_statuses.push((outcome.name.clone(), status));
    }

    let route_rows: HashMap<&str, &RouteRow> = routes.iter().map(|r| (r.name.as_str(), r)).collect();
    let mut route_statuses = Vec::with_capacity(compiled.routes.len());
    let mut route_objects = Vec::with_capacity(compiled.routes.len());
    for outcome in &compiled.routes {
        let Some(row) = route_rows.get(outcome.name.as_str()) else { continue };
        let status = route_status(outcome, &row.status, now_ms);
        route_objects.push(row.to_proto_with(status.clone()));
        route_statuses.push((outcome.name.clone(), status));
    }

    Rendered {
        content: proto::EgressPlan {
            project: project.to_owned(),
            generation: 0,
            services,
            gateways: gateway_objects,
            routes: route_objects,
            node_acks: Vec::new(),
            compiled_at: None,
            dns: Some(dns_in_force(dns.as_ref().map(|row| &row.spec))),
        },
        gateways: gateway_statuses,
        routes: route_statuses,
    }
}

/// The DNS config a project's workloads resolve with: `applied`, or the
/// default (no upstream, no search domain), with ndots always set.
pub(crate) fn dns_in_force(applied: Option<&proto::DnsConfig>) -> proto::DnsConfig {
    let mut dns = applied.cloned().unwrap_or_default();
    dns.ndots = Some(dns.ndots.unwrap_or(DEFAULT_NDOTS));
    dns
}

fn destination(d: &Destination) -> proto::Destination {
    proto::Destination {
        listener: d.listener.to_string(),
        protocol: d.protocol.to_proto() as i32,
        listener_port: d.listener_port.into(),
        hostname: d.hostname.to_string(),
        ports: d.ports.iter().map(|&p| u32::from(p)).collect(),
        route: d.route.to_string(),
    }
}

fn condition(kind: &str, holds: bool, reason: &str, message: String, generation: u64) -> Condition {
    Condition {
        r#type: kind.to_owned(),
        status: if holds { ConditionStatus::True } else { ConditionStatus::False } as i32,
        reason: reason.to_owned(),
        message,
        last_transition_time: None,
        observed_generation: generation,
    }
}

/// Keeps `before`'s transition time when the status held, else stamps `now_ms`.
fn stamp(condition: &mut Condition, before: Option<&Condition>, now_ms: i64) {
    condition.last_transition_time = match before {
        Some(before) if before.status == condition.status => before.last_transition_time,
        _ => Some(timestamp(now_ms)),
    };
}

fn stamp_all(conditions: &mut [Condition], before: &[Condition], now_ms: i64) {
    for condition in conditions {
        let previous = before.iter().find(|b| b.r#type == condition.r#type);
        stamp(condition, previous, now_ms);
    }
}

fn gateway_status(outcome: &GatewayOutcome, before: &proto::GatewayStatus, now_ms: i64) -> proto::GatewayStatus {
    let generation = outcome.generation;
    let mut conditions = vec![condition(
        READY,
        true,
        reason::ACCEPTED,
        format!(
            "listeners: {}, routes attached: {}, services selecting it: {}",
            outcome.listeners.len(),
            outcome.attached_routes,
            outcome.services
        ),
        generation,
    )];
    stamp_all(&mut conditions, &before.conditions, now_ms);
    let listeners = outcome
        .listeners
        .iter()
        .map(|listener| {
            let mut conditions = vec![condition(ACCEPTED, true, reason::ACCEPTED, String::new(), generation)];
            if !listener.conflicts.is_empty() {
                conditions.push(condition(
                    CONFLICTED,
                    true,
                    reason::ROUTE_CONFLICT,
                    format!("a TCP listener carries one allow route; refused: {}", listener.conflicts.join(", ")),
                    generation,
                ));
            }
            let previous = before.listeners.iter().find(|l| l.name == listener.name);
            stamp_all(&mut conditions, previous.map_or(&[][..], |l| &l.conditions), now_ms);
            proto::ListenerStatus { name: listener.name.clone(), attached_routes: listener.attached_routes, conditions }
        })
        .collect();
    proto::GatewayStatus { conditions, listeners }
}

fn route_status(outcome: &RouteOutcome, before: &proto::RouteStatus, now_ms: i64) -> proto::RouteStatus {
    let parents = outcome
        .parents
        .iter()
        .map(|parent| {
            let parent_ref = proto::ParentRef {
                gateway: parent.parent.gateway.clone(),
                listener: parent.parent.listener.clone().unwrap_or_default(),
            };
            let mut conditions = vec![condition(
                ACCEPTED,
                parent.verdict.accepted(),
                parent.verdict.reason(),
                parent.verdict.message(),
                outcome.generation,
            )];
            let previous = before.parents.iter().find(|p| p.parent_ref.as_ref() == Some(&parent_ref));
            stamp_all(&mut conditions, previous.map_or(&[][..], |p| &p.conditions), now_ms);
            proto::RouteParentStatus { parent_ref: Some(parent_ref), conditions }
        })
        .collect();
    proto::RouteStatus { parents }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::{PlanInputs, ServiceInput, compile};
    use crate::model::Selection;

    #[test]
    fn rendering_again_over_its_own_output_changes_nothing_but_a_flip_restamps() {
        let inputs = PlanInputs {
            services: vec![ServiceInput { service: "web".into(), selection: Selection::Gateway("default".into()) }],
            ..Default::default()
        };
        let none = Declared { gateways: Vec::new(), routes: Vec::new(), dns: None };
        let first = render("team", &compile(&inputs), &none, None, 1_000);
        assert_eq!(first.content.dns, Some(proto::DnsConfig { ndots: Some(1), ..Default::default() }), "the default");
        let condition = first.content.services[0].condition.clone().unwrap();
        assert_eq!(condition.reason, reason::GATEWAY_NOT_FOUND);
        assert_eq!(condition.last_transition_time, Some(timestamp(1_000)));

        let again = render("team", &compile(&inputs), &none, Some(&first.content), 5_000);
        assert_eq!(again, first, "a repeat renders identically, so nothing is written");

        let disabled = PlanInputs {
            services: vec![ServiceInput { service: "web".into(), selection: Selection::Disabled }],
            ..Default::default()
        };
        let flipped = render("team", &compile(&disabled), &none, Some(&first.content), 9_000);
        let condition = flipped.content.services[0].condition.clone().unwrap();
        assert_eq!(condition.status, ConditionStatus::True as i32);
        assert_eq!(condition.last_transition_time, Some(timestamp(9_000)));
    }
}
