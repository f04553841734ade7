//! Any berth message in the proto3 JSON mapping, as `grpcurl` prints it.
//!
//! The CLI's `-o json` prints what the server answered through [`to_json`], so a
//! script written against `grpcurl` output reads `berth … -o json` unchanged and no
//! hand-written converter can drift from the .proto files.
//!
//! # The mapping
//! The canonical one, with `grpcurl`'s defaults: lowerCamelCase field names
//! (`nodeId`), enums by their value names (`NODE_STATE_UP`), 64-bit integers as
//! strings, timestamps as RFC 3339 strings, and fields holding their default value
//! left out (an unset `optional` field too, so an `exitCode` of `0` is told apart
//! from none). An enum number this build does not know prints as the number.

use std::sync::LazyLock;

use prost_reflect::{DescriptorError, DescriptorPool, DynamicMessage, SerializeOptions};
use serde_json::Value;

/// Why a message could not be put into JSON.
#[derive(Debug, thiserror::Error)]
pub enum JsonError {
    /// The descriptor set compiled into this crate does not decode.
    #[error("the API's descriptor set does not decode")]
    Descriptors(#[source] &'static DescriptorError),
    /// The message's type is not in the API's descriptor set.
    #[error("{0} is not a message of the berth API")]
    UnknownType(String),
    /// The message's encoding does not match its descriptor.
    #[error("{name} does not decode by its descriptor")]
    Decode {
        /// The message's full name.
        name: String,
        #[source]
        source: prost::DecodeError,
    },
    /// The JSON serializer refused a value.
    #[error("{name} cannot be written as JSON")]
    Serialize {
        /// The message's full name.
        name: String,
        #[source]
        source: serde_json::Error,
    },
}

/// The descriptors of the whole API, decoded once.
static POOL: LazyLock<Result<DescriptorPool, DescriptorError>> =
    LazyLock::new(|| DescriptorPool::decode(crate::FILE_DESCRIPTOR_SET));

/// `message` in the proto3 JSON mapping (see the module docs).
pub fn to_json<M: prost::Message + prost::Name>(message: &M) -> Result<Value, JsonError> {
    let pool = POOL.as_ref().map_err(JsonError::Descriptors)?;
    let name = M::full_name();
    let descriptor = pool.get_message_by_name(&name).ok_or_else(|| JsonError::UnknownType(name.clone()))?;
    let dynamic = DynamicMessage::decode(descriptor, message.encode_to_vec().as_slice())
        .map_err(|source| JsonError::Decode { name: name.clone(), source })?;
    dynamic
        .serialize_with_options(serde_json::value::Serializer, &SerializeOptions::new())
        .map_err(|source| JsonError::Serialize { name, source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::v1::{GetNodeResponse, Node, NodeState};
    use crate::leases::v1::{Lease, LeasePhase};
    use crate::types::v1::Capacity;

    #[test]
    fn a_message_reads_as_grpcurl_prints_it() {
        let response = GetNodeResponse {
            node: Some(Node {
                node_id: "n1".into(),
                state: NodeState::Draining as i32,
                incarnation: 3,
                joined_at: Some(prost_types::Timestamp { seconds: 1_700_000_000, nanos: 0 }),
                capacity: Some(Capacity { cpu_millis: 2000, memory_bytes: 1024 }),
                labels: [("rack".to_string(), "r4".to_string())].into(),
                ..Default::default()
            }),
        };
        let value = to_json(&response).unwrap();
        let node = &value["node"];
        assert_eq!(node["nodeId"], "n1");
        assert_eq!(node["state"], "NODE_STATE_DRAINING");
        assert_eq!(node["joinedAt"], "2023-11-14T22:13:20Z");
        assert_eq!(node["capacity"]["memoryBytes"], "1024", "64-bit integers are strings");
        assert_eq!(node["labels"]["rack"], "r4");
        assert!(node.get("lastHeartbeatAt").is_none(), "an unset timestamp is left out: {node}");
        assert!(node.get("tier").is_none(), "an empty string is left out: {node}");
    }

    #[test]
    fn an_unset_optional_field_is_told_apart_from_zero() {
        let mut lease = Lease { lease_id: "l1".into(), phase: LeasePhase::Failed as i32, ..Default::default() };
        assert!(to_json(&lease).unwrap().get("exitCode").is_none());
        lease.exit_code = Some(0);
        assert_eq!(to_json(&lease).unwrap()["exitCode"], 0);
    }

    #[test]
    fn an_enum_number_this_build_does_not_know_prints_as_the_number() {
        let node = Node { state: 99, ..Default::default() };
        assert_eq!(to_json(&node).unwrap()["state"], 99);
    }
}
