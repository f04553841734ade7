//! Gateways, routes and plans as the database holds them, and as the API and
//! the compile see them.
//!
//! # What is stored
//! Declarations, statuses and plan contents are protobuf encodings of their
//! API messages, so a field added to one needs no migration. Times are epoch
//! milliseconds on the database clock.

use berth_proto::egress::v1 as proto;
use berth_store::StoreError;
use prost::Message;
use sqlx::Row as _;
use sqlx::any::AnyRow;

use crate::compile::{GatewaySpec, ListenerSpec, ParentSpec, RouteSpec};
use crate::model::{HostPattern, Protocol, RouteAction};

/// The columns [`ObjectRow::from_row`] reads.
macro_rules! object_columns {
    () => {
        "project, name, spec, status, generation, created_at_ms, updated_at_ms"
    };
}

pub(crate) use object_columns;

pub(crate) fn decode<M: Message + Default>(row: &AnyRow, column: &str) -> Result<M, StoreError> {
    let bytes: Vec<u8> = row.try_get(column)?;
    M::decode(bytes.as_slice()).map_err(|e| StoreError::Internal {
        context: format!("decoding the stored {column}"),
        source: Some(Box::new(e)),
    })
}

pub(crate) use berth_proto::timestamp_from_ms as timestamp;

/// A stored count as the API counts it.
pub(crate) fn unsigned(value: i64) -> u64 {
    u64::try_from(value).unwrap_or_default()
}

/// One declared object (a gateway or a route), as stored: its declaration
/// `S` and status `T` as the API's messages.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ObjectRow<S, T> {
    pub(crate) project: String,
    pub(crate) name: String,
    pub(crate) spec: S,
    pub(crate) status: T,
    pub(crate) generation: i64,
    pub(crate) created_at_ms: i64,
    pub(crate) updated_at_ms: i64,
}

impl<S: Message + Default, T: Message + Default> ObjectRow<S, T> {
    /// Decodes a row selected with [`object_columns!`].
    pub(crate) fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        Ok(Self {
            project: row.try_get("project")?,
            name: row.try_get("name")?,
            spec: decode(row, "spec")?,
            status: decode(row, "status")?,
            generation: row.try_get("generation")?,
            created_at_ms: row.try_get("created_at_ms")?,
            updated_at_ms: row.try_get("updated_at_ms")?,
        })
    }
}

/// One gateway, as stored.
pub(crate) type GatewayRow = ObjectRow<proto::ApplyGatewayRequest, proto::GatewayStatus>;

/// One route, as stored.
pub(crate) type RouteRow = ObjectRow<proto::ApplyRouteRequest, proto::RouteStatus>;

/// A project's DNS config, as stored (it has no status).
pub(crate) type DnsRow = ObjectRow<proto::DnsConfig, ()>;

impl DnsRow {
    /// The config as the API shows it.
    pub(crate) fn to_proto(&self) -> proto::EgressDnsConfig {
        proto::EgressDnsConfig {
            project: self.project.clone(),
            spec: Some(self.spec.clone()),
            generation: unsigned(self.generation),
            created_at: Some(timestamp(self.created_at_ms)),
            updated_at: Some(timestamp(self.updated_at_ms)),
        }
    }
}

impl GatewayRow {
    /// The gateway as the API shows it, with `status`.
    pub(crate) fn to_proto_with(&self, status: proto::GatewayStatus) -> proto::EgressGateway {
        proto::EgressGateway {
            project: self.project.clone(),
            name: self.name.clone(),
            listeners: self.spec.listeners.clone(),
            status: Some(status),
            generation: unsigned(self.generation),
            created_at: Some(timestamp(self.created_at_ms)),
            updated_at: Some(timestamp(self.updated_at_ms)),
        }
    }

    /// The gateway as the API shows it.
    pub(crate) fn to_proto(&self) -> proto::EgressGateway {
        self.to_proto_with(self.status.clone())
    }

    /// What the compile reads. Listeners were checked on apply; one that no
    /// longer reads (an unknown protocol) is left out.
    pub(crate) fn to_spec(&self) -> GatewaySpec {
        GatewaySpec {
            name: self.name.clone(),
            generation: unsigned(self.generation),
            listeners: self
                .spec
                .listeners
                .iter()
                .filter_map(|l| {
                    Some(ListenerSpec {
                        name: l.name.clone(),
                        protocol: Protocol::from_proto(l.protocol)?,
                        port: u16::try_from(l.port).ok()?,
                    })
                })
                .collect(),
        }
    }
}

impl RouteRow {
    /// The route as the API shows it, with `status`.
    pub(crate) fn to_proto_with(&self, status: proto::RouteStatus) -> proto::EgressRoute {
        proto::EgressRoute {
            project: self.project.clone(),
            name: self.name.clone(),
            parent_refs: self.spec.parent_refs.clone(),
            hostnames: self.spec.hostnames.clone(),
            ports: self.spec.ports.clone(),
            action: self.spec.action,
            status: Some(status),
            generation: unsigned(self.generation),
            created_at: Some(timestamp(self.created_at_ms)),
            updated_at: Some(timestamp(self.updated_at_ms)),
        }
    }

    /// The route as the API shows it.
    pub(crate) fn to_proto(&self) -> proto::EgressRoute {
        self.to_proto_with(self.status.clone())
    }

    /// What the compile reads. Fields were checked on apply; a value that no
    /// longer reads is left out.
    pub(crate) fn to_spec(&self) -> RouteSpec {
        RouteSpec {
            name: self.name.clone(),
            generation: unsigned(self.generation),
            parents: self.spec.parent_refs.iter().map(ParentSpec::from_proto).collect(),
            hostnames: self.spec.hostnames.iter().filter_map(|h| HostPattern::parse(h).ok()).collect(),
            ports: self.spec.ports.iter().filter_map(|p| u16::try_from(*p).ok()).collect(),
            action: RouteAction::from_proto(self.spec.action).unwrap_or(RouteAction::Allow),
        }
    }
}

/// What a project declares, as one pass reads it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Declared {
    pub(crate) gateways: Vec<GatewayRow>,
    pub(crate) routes: Vec<RouteRow>,
    pub(crate) dns: Option<DnsRow>,
}

/// One project's plan, as stored.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PlanRow {
    pub(crate) project: String,
    pub(crate) generation: i64,
    /// The plan without generation, node acks and compile time.
    pub(crate) content: proto::EgressPlan,
    pub(crate) compiled_at_ms: i64,
}

impl PlanRow {
    /// Decodes `project, generation, content, compiled_at_ms`.
    pub(crate) fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        Ok(Self {
            project: row.try_get("project")?,
            generation: row.try_get("generation")?,
            content: decode(row, "content")?,
            compiled_at_ms: row.try_get("compiled_at_ms")?,
        })
    }

    /// The plan as the API shows it, with `node_acks`.
    pub(crate) fn to_proto(&self, node_acks: Vec<proto::NodeAck>) -> proto::EgressPlan {
        let mut plan = self.content.clone();
        plan.project.clone_from(&self.project);
        plan.generation = unsigned(self.generation);
        plan.compiled_at = Some(timestamp(self.compiled_at_ms));
        plan.node_acks = node_acks;
        plan
    }
}
