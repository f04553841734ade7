//! Placement: which node each of a batch of lease requests goes to, as a pure
//! function of the nodes and the requests, so a plan is deterministic and can
//! be tested as a table.
//!
//! # The rule
//! A request may go to a node that is `UP`, in the request's tier (an empty
//! tier means any), whose runtime satisfies what its workload needs (see
//! [`RuntimeNeed`]; a node says what it runs in its labels), and has room
//! for it in both dimensions. Among those it goes to the first by:
//! 1. fewest open leases of the request's spread group (so a group's leases
//!    land on different nodes while any node without one fits);
//! 2. holding the heads of the request's cache volumes (a node that sealed
//!    a head holds it: the lease's view starts warm there);
//! 3. most free, where a node's freeness is the free fraction of its scarcer
//!    dimension, `min(free cpu / total cpu, free memory / total memory)`,
//!    compared exactly (no floating point);
//! 4. lowest node id.
//!
//! # Invariants
//! - Requests are placed in order and each placement is tallied on its node
//!   before the next request is considered, so a batch spreads instead of
//!   stacking on the node that was emptiest when the batch began.
//! - A request that fits nowhere gets a [`Shortage`] and changes no tally.

use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeMap, HashMap};
use std::fmt;

use berth_proto::identity::v1::NodeState;
use berth_proto::leases::v1::Workload;
use berth_proto::types::v1::RuntimeClass;

use crate::model::Resources;

/// A node as placement sees it: where it is, whether it takes leases, what it
/// offers and what its open leases already hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacementNode {
    /// The node's id.
    pub node_id: String,
    /// The node's tier; empty means none.
    pub tier: String,
    /// The node's state as identity describes it; only `UP` takes new leases.
    pub state: NodeState,
    /// What the node offers to leases.
    pub total: Resources,
    /// What open leases on the node reserve.
    pub allocated: Resources,
    /// Open leases on the node per spread group key.
    pub spread: BTreeMap<String, u32>,
    /// What runs its workloads.
    pub runtime: NodeRuntime,
}

/// The node label naming what runs a node's workloads.
pub(crate) const RUNTIME_LABEL: &str = "berth.runtime";

/// The node label saying whether a node contains its workloads.
pub(crate) const CONTAINED_LABEL: &str = "berth.contained";

use berth_core::{MEMORY_FLOOR_LABEL, MEMORY_OVERHEAD_LABEL};

/// What runs a node's workloads, as its labels say; a node that says
/// nothing runs only workloads that need nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeRuntime {
    /// `process`, `runc`, `crun` or `runsc`; empty when unknown.
    pub name: String,
    /// Whether it contains its workloads.
    pub contained: bool,
    /// The memory each workload holds beyond its lease's size.
    pub memory_overhead: u64,
    /// The least memory a workload holds, whatever its lease asks.
    pub memory_floor: u64,
}

impl NodeRuntime {
    /// From a node's labels; a size label that is not a number of bytes
    /// counts as none.
    pub fn of_labels(labels: &HashMap<String, String>) -> Self {
        let bytes = |label: &str| labels.get(label).and_then(|value| value.parse().ok()).unwrap_or(0);
        Self {
            name: labels.get(RUNTIME_LABEL).cloned().unwrap_or_default(),
            contained: labels.get(CONTAINED_LABEL).is_some_and(|v| v == "true"),
            memory_overhead: bytes(MEMORY_OVERHEAD_LABEL),
            memory_floor: bytes(MEMORY_FLOOR_LABEL),
        }
    }

    /// What a lease of `size` holds of the node: its size, its memory
    /// raised to the floor, plus the overhead.
    pub fn footprint(&self, size: Resources) -> Resources {
        Resources::new(size.cpu_millis, size.memory_bytes.max(self.memory_floor).saturating_add(self.memory_overhead))
    }

    /// Whether it runs container images: every containing runtime does
    /// (an OCI runtime binary, or the agent's own process runtime).
    fn runs_images(&self) -> bool {
        matches!(self.name.as_str(), "runc" | "crun" | "runsc" | "microvm")
            || (self.name == "process" && self.contained)
    }

    /// Whether a workload needing `need` may run here.
    pub fn satisfies(&self, need: RuntimeNeed) -> bool {
        (!need.oci || self.runs_images())
            && (!need.contained || self.contained)
            && (!need.sandboxed || (self.name == "runsc" && self.contained))
            && (!need.microvm || (self.name == "microvm" && self.contained))
    }
}

/// What a workload needs of its node's runtime.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RuntimeNeed {
    /// A runtime that runs container images: one that contains.
    pub oci: bool,
    /// A runtime that contains its workloads.
    pub contained: bool,
    /// gVisor.
    pub sandboxed: bool,
    /// A microVM of its own.
    pub microvm: bool,
}

impl RuntimeNeed {
    /// What `workload` needs: its runtime class, and an OCI runtime for an image.
    pub fn of_workload(workload: &Workload) -> Self {
        let class = RuntimeClass::try_from(workload.runtime).unwrap_or(RuntimeClass::Unspecified);
        Self {
            oci: workload.image.is_some(),
            // A cache volume is mounted inside the workload's own root.
            contained: matches!(class, RuntimeClass::Contained | RuntimeClass::Sandboxed | RuntimeClass::Microvm)
                || !workload.cache.is_empty(),
            sandboxed: class == RuntimeClass::Sandboxed,
            microvm: class == RuntimeClass::Microvm,
        }
    }

    /// Whether it needs nothing.
    pub fn any(self) -> bool {
        self == Self::default()
    }
}

impl fmt::Display for RuntimeNeed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if self.sandboxed {
            parts.push("runs gVisor (runsc)");
        } else if self.microvm {
            parts.push("runs microVMs");
        } else if self.contained {
            parts.push("contains its workloads");
        }
        if self.oci && !self.sandboxed && !self.microvm {
            parts.push("runs container images (a containing runtime)");
        }
        f.write_str(&parts.join(" and "))
    }
}

impl PlacementNode {
    /// An empty node in `state`, offering `total`.
    pub fn new(node_id: impl Into<String>, tier: impl Into<String>, state: NodeState, total: Resources) -> Self {
        Self {
            node_id: node_id.into(),
            tier: tier.into(),
            state,
            total,
            allocated: Resources::default(),
            spread: BTreeMap::new(),
            runtime: NodeRuntime::default(),
        }
    }

    /// The same node, run by `runtime`.
    pub fn with_runtime(mut self, runtime: NodeRuntime) -> Self {
        self.runtime = runtime;
        self
    }

    /// What one more lease may take.
    pub fn free(&self) -> Resources {
        self.total.minus(self.allocated)
    }

    fn freeness(&self) -> Fraction {
        let free = self.free();
        Fraction::new(free.cpu_millis, self.total.cpu_millis)
            .min(Fraction::new(free.memory_bytes, self.total.memory_bytes))
    }

    fn in_tier(&self, tier: &str) -> bool {
        tier.is_empty() || self.tier == tier
    }

    /// Whether it may take `request` at all, room aside.
    fn eligible(&self, request: &PlacementRequest) -> bool {
        self.state == NodeState::Up && self.in_tier(&request.tier) && self.runtime.satisfies(request.runtime)
    }

    /// What `request` would hold of this node.
    pub fn footprint(&self, request: &PlacementRequest) -> Resources {
        self.runtime.footprint(request.resources)
    }

    fn spread_count(&self, group: &str) -> u32 {
        if group.is_empty() { 0 } else { self.spread.get(group).copied().unwrap_or(0) }
    }
}

/// One request to place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacementRequest {
    /// What the lease reserves.
    pub resources: Resources,
    /// The tier it must go to; empty means any.
    pub tier: String,
    /// Its spread group key (scoped by the caller, e.g. by project); empty means none.
    pub spread_group: String,
    /// What it needs of its node's runtime.
    pub runtime: RuntimeNeed,
    /// The nodes holding the heads of its cache volumes (preferred).
    pub warm_nodes: Vec<String>,
}

/// Where one request went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// Placed on the node with this id.
    Node(String),
    /// No node had room.
    NoRoom(Shortage),
}

impl Placement {
    /// The node it was placed on, if any.
    pub fn node_id(&self) -> Option<&str> {
        match self {
            Placement::Node(node_id) => Some(node_id),
            Placement::NoRoom(_) => None,
        }
    }
}

/// The outcome of [`place`]: one [`Placement`] per request, in request order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PlacementPlan {
    /// Where each request went.
    pub placements: Vec<Placement>,
}

impl PlacementPlan {
    /// The node each request went to, `None` where it fit nowhere.
    pub fn node_ids(&self) -> Vec<Option<&str>> {
        self.placements.iter().map(Placement::node_id).collect()
    }
}

/// Why a request fit nowhere: what it asked for and what the tier offered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shortage {
    /// The tier asked for; empty means any.
    pub tier: String,
    /// What it needs of a node's runtime.
    pub runtime: RuntimeNeed,
    /// What the request asked for.
    pub wanted: Resources,
    /// How many `UP` nodes the tier has.
    pub up_nodes: usize,
    /// No `UP` node in the tier has this much CPU free.
    pub cpu_short: bool,
    /// No `UP` node in the tier has this much memory free.
    pub memory_short: bool,
    /// The most free `UP` node in the tier and what it has free.
    pub most_free: Option<(String, Resources)>,
}

impl fmt::Display for Shortage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tier = if self.tier.is_empty() { "any tier".to_owned() } else { format!("tier '{}'", self.tier) };
        write!(f, "no UP node in {tier}")?;
        if !self.runtime.any() {
            write!(f, " that {}", self.runtime)?;
        }
        let Some((node_id, free)) = &self.most_free else {
            return Ok(());
        };
        let memory = crate::model::Memory(self.wanted.memory_bytes);
        match (self.cpu_short, self.memory_short) {
            (true, false) => write!(f, " has {}m cpu free", self.wanted.cpu_millis)?,
            (false, true) => write!(f, " has {memory} memory free")?,
            // Short in both, or each fits somewhere but never both on one node.
            _ => write!(f, " has {}m cpu and {memory} memory free", self.wanted.cpu_millis)?,
        }
        write!(f, "; most free: {node_id} with {free} free")
    }
}

/// A non-negative fraction, ordered exactly; `x / 0` counts as nothing free.
#[derive(Debug, Clone, Copy)]
struct Fraction {
    numerator: u64,
    denominator: u64,
}

impl Fraction {
    fn new(numerator: u64, denominator: u64) -> Self {
        if denominator == 0 { Self { numerator: 0, denominator: 1 } } else { Self { numerator, denominator } }
    }
}

impl PartialEq for Fraction {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Fraction {}

impl PartialOrd for Fraction {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Fraction {
    fn cmp(&self, other: &Self) -> Ordering {
        let left = u128::from(self.numerator) * u128::from(other.denominator);
        let right = u128::from(other.numerator) * u128::from(self.denominator);
        left.cmp(&right)
    }
}

/// Places `requests` in order on `nodes`; see the module docs for the rule.
pub fn place(nodes: &[PlacementNode], requests: &[PlacementRequest]) -> PlacementPlan {
    let mut nodes: Vec<PlacementNode> = nodes.to_vec();
    let mut placements = Vec::with_capacity(requests.len());
    for request in requests {
        let chosen =
            nodes.iter_mut().filter(|n| n.eligible(request) && n.free().holds(n.footprint(request))).min_by(|a, b| {
                let key = |n: &PlacementNode| {
                    let cold = !request.warm_nodes.contains(&n.node_id);
                    (n.spread_count(&request.spread_group), cold, Reverse(n.freeness()))
                };
                key(a).cmp(&key(b)).then_with(|| a.node_id.cmp(&b.node_id))
            });
        match chosen {
            Some(node) => {
                node.allocated = node.allocated.plus(node.footprint(request));
                if !request.spread_group.is_empty() {
                    *node.spread.entry(request.spread_group.clone()).or_default() += 1;
                }
                placements.push(Placement::Node(node.node_id.clone()));
            }
            None => placements.push(Placement::NoRoom(shortage(&nodes, request))),
        }
    }
    PlacementPlan { placements }
}

fn shortage(nodes: &[PlacementNode], request: &PlacementRequest) -> Shortage {
    let up: Vec<&PlacementNode> = nodes.iter().filter(|n| n.eligible(request)).collect();
    let wanted = request.resources;
    let most_free = up
        .iter()
        .min_by(|a, b| Reverse(a.freeness()).cmp(&Reverse(b.freeness())).then_with(|| a.node_id.cmp(&b.node_id)))
        .map(|n| (n.node_id.clone(), n.free()));
    Shortage {
        tier: request.tier.clone(),
        runtime: request.runtime,
        wanted,
        up_nodes: up.len(),
        cpu_short: up.iter().all(|n| n.free().cpu_millis < n.footprint(request).cpu_millis),
        memory_short: up.iter().all(|n| n.free().memory_bytes < n.footprint(request).memory_bytes),
        most_free,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn node(id: &str, cpu: u64, memory_gib: u64) -> PlacementNode {
        PlacementNode::new(id, "", NodeState::Up, Resources::new(cpu, memory_gib * GIB))
    }

    fn holding(mut node: PlacementNode, cpu: u64, memory_gib: u64) -> PlacementNode {
        node.allocated = Resources::new(cpu, memory_gib * GIB);
        node
    }

    fn ask(cpu: u64, memory_gib: u64) -> PlacementRequest {
        PlacementRequest {
            warm_nodes: Vec::new(),
            resources: Resources::new(cpu, memory_gib * GIB),
            tier: String::new(),
            spread_group: String::new(),
            runtime: RuntimeNeed::default(),
        }
    }

    fn grouped(cpu: u64, memory_gib: u64, group: &str) -> PlacementRequest {
        PlacementRequest { spread_group: group.to_owned(), ..ask(cpu, memory_gib) }
    }

    fn in_tier(request: PlacementRequest, tier: &str) -> PlacementRequest {
        PlacementRequest { tier: tier.to_owned(), ..request }
    }

    fn placed(plan: &PlacementPlan) -> Vec<&str> {
        plan.node_ids().into_iter().map(|n| n.unwrap_or("-")).collect()
    }

    #[test]
    fn a_lease_with_a_cache_goes_to_a_node_holding_its_head_among_those_that_fit_after_spread() {
        let nodes = [node("n-1", 4000, 8), holding(node("n-2", 4000, 8), 2000, 4), node("n-3", 4000, 8)];
        let warm = |request: PlacementRequest, on: &[&str]| PlacementRequest {
            warm_nodes: on.iter().map(|n| (*n).to_owned()).collect(),
            ..request
        };
        // Warm beats freer.
        let plan = place(&nodes, &[warm(ask(100, 1), &["n-2"])]);
        assert_eq!(plan.placements[0].node_id(), Some("n-2"));
        // A warm node without room is passed over.
        let plan = place(&nodes, &[warm(ask(3000, 1), &["n-2"])]);
        assert_eq!(plan.placements[0].node_id(), Some("n-1"));
        // Spread comes first: the group's second lease leaves the warm node.
        let plan = place(&nodes, &[warm(grouped(100, 1, "g"), &["n-2"]), warm(grouped(100, 1, "g"), &["n-2"])]);
        assert_eq!(plan.placements[0].node_id(), Some("n-2"));
        assert_eq!(plan.placements[1].node_id(), Some("n-1"));
        // A workload with a cache needs a node that contains.
        let workload = Workload { cache: vec![Default::default()], ..Default::default() };
        assert!(RuntimeNeed::of_workload(&workload).contained);
    }

    #[test]
    fn placement_table() {
        struct Case {
            name: &'static str,
            nodes: Vec<PlacementNode>,
            requests: Vec<PlacementRequest>,
            expected: Vec<&'static str>,
        }
        let cases = vec![
            Case {
                name: "one spread group goes to three different nodes, even where one is emptier",
                nodes: vec![node("n-1", 4000, 8), holding(node("n-2", 4000, 8), 2000, 4), node("n-3", 4000, 8)],
                requests: vec![grouped(500, 1, "web"), grouped(500, 1, "web"), grouped(500, 1, "web")],
                expected: vec!["n-1", "n-3", "n-2"],
            },
            Case {
                name: "a group already on a node avoids it while another fits",
                nodes: vec![
                    PlacementNode { spread: BTreeMap::from([("web".to_owned(), 1)]), ..node("n-1", 8000, 16) },
                    holding(node("n-2", 4000, 8), 3000, 6),
                ],
                requests: vec![grouped(500, 1, "web")],
                expected: vec!["n-2"],
            },
            Case {
                name: "a group doubles up only when every node that fits has one",
                nodes: vec![node("n-1", 4000, 8), node("n-2", 1000, 2)],
                requests: vec![grouped(800, 1, "web"), grouped(800, 1, "web"), grouped(800, 1, "web")],
                expected: vec!["n-1", "n-2", "n-1"],
            },
            Case {
                name: "least loaded across groups: the scarcer dimension's free fraction decides",
                nodes: vec![
                    // 75% cpu free but 25% memory free: 25%.
                    holding(node("n-1", 4000, 8), 1000, 6),
                    // 50% of both free: 50%.
                    holding(node("n-2", 4000, 8), 2000, 4),
                    // 40% cpu free, 90% memory free: 40%.
                    holding(node("n-3", 10000, 10), 6000, 1),
                ],
                requests: vec![grouped(100, 1, "a"), grouped(100, 1, "b")],
                expected: vec!["n-2", "n-3"],
            },
            Case {
                name: "ties go to the lowest node id",
                nodes: vec![node("n-3", 4000, 8), node("n-1", 4000, 8), node("n-2", 4000, 8)],
                requests: vec![ask(1000, 2)],
                expected: vec!["n-1"],
            },
            Case {
                name: "equal fractions of different sizes tie too",
                nodes: vec![node("n-b", 8000, 16), node("n-a", 4000, 8)],
                requests: vec![ask(1000, 1)],
                expected: vec!["n-a"],
            },
            Case {
                name: "a batch tallies as it goes, spreading instead of stacking",
                nodes: vec![node("n-1", 4000, 8), node("n-2", 4000, 8), node("n-3", 4000, 8)],
                requests: vec![ask(1000, 2), ask(1000, 2), ask(1000, 2), ask(1000, 2)],
                expected: vec!["n-1", "n-2", "n-3", "n-1"],
            },
            Case {
                name: "a batch stops at capacity: the fifth 1-core lease finds no room on 4 cores",
                nodes: vec![node("n-1", 4000, 8)],
                requests: vec![ask(1000, 1), ask(1000, 1), ask(1000, 1), ask(1000, 1), ask(1000, 1)],
                expected: vec!["n-1", "n-1", "n-1", "n-1", "-"],
            },
            Case {
                name: "draining, down, joining and revoked nodes get nothing new",
                nodes: vec![
                    PlacementNode { state: NodeState::Draining, ..node("n-1", 8000, 16) },
                    PlacementNode { state: NodeState::Down, ..node("n-2", 8000, 16) },
                    PlacementNode { state: NodeState::Joining, ..node("n-3", 8000, 16) },
                    PlacementNode { state: NodeState::Revoked, ..node("n-4", 8000, 16) },
                    holding(node("n-5", 2000, 4), 1000, 2),
                ],
                requests: vec![ask(1000, 2), ask(1000, 2)],
                expected: vec!["n-5", "-"],
            },
            Case {
                name: "a tier is honoured; no tier means any",
                nodes: vec![
                    PlacementNode { tier: "gpu".to_owned(), ..node("n-1", 4000, 8) },
                    PlacementNode { tier: "batch".to_owned(), ..node("n-2", 8000, 16) },
                ],
                requests: vec![in_tier(ask(1000, 1), "gpu"), in_tier(ask(1000, 1), "edge"), ask(1000, 1)],
                expected: vec!["n-1", "-", "n-2"],
            },
            Case {
                name: "a request bigger than any node fits nowhere but the rest still place",
                nodes: vec![node("n-1", 4000, 8)],
                requests: vec![ask(8000, 1), ask(1000, 1)],
                expected: vec!["-", "n-1"],
            },
        ];
        for case in cases {
            let plan = place(&case.nodes, &case.requests);
            assert_eq!(placed(&plan), case.expected, "{}", case.name);
        }
    }

    #[test]
    fn no_room_names_the_short_dimension_and_the_most_free_node() {
        let nodes = vec![
            PlacementNode { tier: "x".to_owned(), ..holding(node("n-1", 4000, 8), 3500, 1) },
            PlacementNode { tier: "x".to_owned(), ..holding(node("n-2", 4000, 8), 3800, 1) },
            PlacementNode { tier: "y".to_owned(), ..node("n-3", 64000, 64) },
        ];
        let plan = place(&nodes, &[in_tier(ask(2000, 1), "x")]);
        let Placement::NoRoom(shortage) = &plan.placements[0] else { panic!("placed: {plan:?}") };
        assert_eq!(shortage.up_nodes, 2);
        assert!(shortage.cpu_short && !shortage.memory_short);
        assert_eq!(
            shortage.to_string(),
            "no UP node in tier 'x' has 2000m cpu free; most free: n-1 with 500m cpu and 7GiB memory free"
        );
    }

    #[test]
    fn no_room_in_memory_or_in_both_at_once_says_so() {
        let nodes = vec![holding(node("n-1", 4000, 8), 0, 7), holding(node("n-2", 4000, 8), 3900, 5)];
        let Placement::NoRoom(memory) = &place(&nodes, &[ask(1000, 4)]).placements[0] else { panic!() };
        assert_eq!(
            memory.to_string(),
            "no UP node in any tier has 4GiB memory free; most free: n-1 with 4000m cpu and 1GiB memory free"
        );
        let Placement::NoRoom(both) = &place(&nodes, &[ask(1000, 2)]).placements[0] else { panic!() };
        assert!(!both.cpu_short && !both.memory_short);
        assert!(both.to_string().starts_with("no UP node in any tier has 1000m cpu and 2GiB memory free"), "{both}");
    }

    #[test]
    fn no_up_node_at_all_says_only_that() {
        let nodes = vec![PlacementNode { state: NodeState::Down, tier: "x".to_owned(), ..node("n-1", 4000, 8) }];
        let Placement::NoRoom(shortage) = &place(&nodes, &[in_tier(ask(1000, 1), "x")]).placements[0] else { panic!() };
        assert_eq!(shortage.to_string(), "no UP node in tier 'x'");
        assert_eq!(shortage.up_nodes, 0);
    }

    #[test]
    fn a_dimension_with_no_total_counts_as_nothing_free() {
        let nodes = vec![node("n-1", 4000, 0), node("n-2", 1000, 1)];
        assert_eq!(placed(&place(&nodes, &[ask(100, 0)])), vec!["n-2"]);
    }

    fn run_by(node: PlacementNode, name: &str, contained: bool) -> PlacementNode {
        node.with_runtime(NodeRuntime { name: name.to_owned(), contained, ..Default::default() })
    }

    #[test]
    fn a_workload_goes_only_to_a_node_whose_runtime_satisfies_it() {
        let sandboxed = RuntimeNeed { contained: true, sandboxed: true, ..RuntimeNeed::default() };
        let microvm = RuntimeNeed { contained: true, microvm: true, ..RuntimeNeed::default() };
        let image = RuntimeNeed { oci: true, ..RuntimeNeed::default() };
        let contained = RuntimeNeed { contained: true, ..RuntimeNeed::default() };
        // The emptiest node runs plain processes; placement passes it over
        // for whatever asks for more than that.
        let nodes = vec![
            run_by(node("n-1", 64000, 64), "process", false),
            run_by(node("n-2", 4000, 8), "runc", true),
            run_by(node("n-3", 2000, 4), "runsc", true),
            node("n-4", 64000, 64),
            run_by(node("n-5", 1000, 2), "microvm", true),
        ];
        let with = |runtime| PlacementRequest { runtime, ..ask(100, 1) };
        assert_eq!(placed(&place(&nodes, &[with(sandboxed)])), vec!["n-3"]);
        assert_eq!(placed(&place(&nodes, &[with(image)])), vec!["n-2"]);
        assert_eq!(placed(&place(&nodes, &[with(RuntimeNeed { sandboxed: true, ..image })])), vec!["n-3"]);
        assert_eq!(placed(&place(&nodes, &[with(microvm)])), vec!["n-5"]);
        assert_eq!(
            placed(&place(&nodes, &[with(RuntimeNeed { microvm: true, ..image })])),
            vec!["n-5"],
            "a VM runs images"
        );
        assert_eq!(placed(&place(&nodes, &[with(contained)])), vec!["n-2"]);
        assert_eq!(placed(&place(&nodes, &[with(RuntimeNeed::default())])), vec!["n-1"], "no need: any node");

        // Where none satisfies it, the refusal says what was needed.
        let plain = vec![run_by(node("n-1", 4000, 8), "runc", true)];
        let Placement::NoRoom(shortage) = &place(&plain, &[with(sandboxed)]).placements[0] else { panic!() };
        assert_eq!(shortage.to_string(), "no UP node in any tier that runs gVisor (runsc)");
        let Placement::NoRoom(shortage) = &place(&plain, &[with(microvm)]).placements[0] else { panic!() };
        assert_eq!(shortage.to_string(), "no UP node in any tier that runs microVMs");
        let processes = vec![run_by(node("n-1", 4000, 8), "process", false)];
        let Placement::NoRoom(shortage) = &place(&processes, &[with(image)]).placements[0] else { panic!() };
        assert_eq!(shortage.to_string(), "no UP node in any tier that runs container images (a containing runtime)");
        let contained_processes = vec![run_by(node("n-1", 4000, 8), "process", true)];
        assert_eq!(
            placed(&place(&contained_processes, &[with(image)])),
            vec!["n-1"],
            "the process runtime runs images"
        );
    }

    #[test]
    fn a_workloads_need_comes_from_its_runtime_class_and_whether_it_runs_an_image() {
        let mut workload = Workload { runtime: RuntimeClass::Sandboxed as i32, ..Workload::default() };
        assert_eq!(
            RuntimeNeed::of_workload(&workload),
            RuntimeNeed { contained: true, sandboxed: true, ..RuntimeNeed::default() }
        );
        workload.runtime = RuntimeClass::Microvm as i32;
        assert_eq!(
            RuntimeNeed::of_workload(&workload),
            RuntimeNeed { contained: true, microvm: true, ..RuntimeNeed::default() }
        );
        workload.runtime = RuntimeClass::Unspecified as i32;
        assert!(RuntimeNeed::of_workload(&workload).any());
        workload.image = Some(berth_proto::types::v1::BundleRef::default());
        assert_eq!(RuntimeNeed::of_workload(&workload), RuntimeNeed { oci: true, ..RuntimeNeed::default() });
        let labels = HashMap::from([
            (RUNTIME_LABEL.to_owned(), "runsc".to_owned()),
            (CONTAINED_LABEL.to_owned(), "true".to_owned()),
        ]);
        assert_eq!(
            NodeRuntime::of_labels(&labels),
            NodeRuntime { name: "runsc".into(), contained: true, ..Default::default() }
        );
    }

    #[test]
    fn a_node_that_declares_a_memory_overhead_is_charged_it_for_every_lease() {
        let labels = HashMap::from([
            (RUNTIME_LABEL.to_owned(), "microvm".to_owned()),
            (CONTAINED_LABEL.to_owned(), "true".to_owned()),
            (MEMORY_OVERHEAD_LABEL.to_owned(), (256_u64 << 20).to_string()),
            (MEMORY_FLOOR_LABEL.to_owned(), (128_u64 << 20).to_string()),
        ]);
        let vm = node("vm", 8000, 1).with_runtime(NodeRuntime::of_labels(&labels));
        // 64 MiB asked: the guest's floor (128 MiB) and the VMM's 256 MiB are held.
        let small = PlacementRequest { resources: Resources::new(100, 64 << 20), ..ask(0, 0) };
        assert_eq!(vm.footprint(&small), Resources::new(100, 384 << 20));
        let plan = place(std::slice::from_ref(&vm), &[small.clone(), small.clone(), small.clone()]);
        assert_eq!(placed(&plan), vec!["vm", "vm", "-"], "two of 384 MiB fit in 1 GiB, a third does not");
        let Placement::NoRoom(shortage) = &plan.placements[2] else { panic!("{plan:?}") };
        assert!(shortage.memory_short, "{shortage:?}");
        // A node that declares nothing (or nonsense) charges the size alone.
        let labels = HashMap::from([(MEMORY_OVERHEAD_LABEL.to_owned(), "lots".to_owned())]);
        assert_eq!(NodeRuntime::of_labels(&labels).footprint(small.resources), small.resources);
    }
}
