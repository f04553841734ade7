//! `berth cache list|get|rollback|pin|unpin|delete|disable|enable`: cache
//! volumes as an operator steers them, through leases' `Caches` service.
//!
//! # Invariants
//! - Nothing here changes a running lease's view: a rollback, delete or
//!   switch applies to the leases that open the volume afterwards.
//! - Keys are checked by the ledger; a refusal names the field.

use berth_proto::leases::v1;
use berth_proto::leases::v1::caches_client::CachesClient;

use super::lease::LeasesServerArgs;
use super::output::{self, Table};
use super::{CliError, ClientArgs, OutputFormat, ProjectScopeArgs};

/// Flags of `berth cache`.
#[derive(Debug, clap::Args)]
pub(crate) struct CacheArgs {
    #[command(flatten)]
    client: ClientArgs,
    #[command(flatten)]
    leases: LeasesServerArgs,
    #[command(subcommand)]
    command: CacheCommand,
}

/// One volume: its key and project.
#[derive(Debug, clap::Args)]
struct VolumeArgs {
    /// The volume's key.
    #[arg(id = "cache_key", value_name = "KEY")]
    key: String,
    /// Its project [default: default].
    #[arg(long, value_name = "PROJECT")]
    project: Option<String>,
}

#[derive(Debug, clap::Subcommand)]
enum CacheCommand {
    /// List cache volumes: each one's head, kept generations and size.
    List(ProjectScopeArgs),
    /// Show one volume and its kept generations, newest first.
    Get(VolumeArgs),
    /// Make a kept generation the head (0 starts the next lease empty), e.g.
    /// `berth cache rollback cargo-main --to 3`.
    Rollback {
        #[command(flatten)]
        volume: VolumeArgs,
        /// The generation new leases start from.
        #[arg(long, value_name = "GENERATION")]
        to: u64,
    },
    /// Keep a generation whatever the collection of old ones would drop.
    Pin {
        #[command(flatten)]
        volume: VolumeArgs,
        /// The generation.
        #[arg(long, value_name = "GENERATION")]
        generation: u64,
    },
    /// Let a pinned generation be collected again.
    Unpin {
        #[command(flatten)]
        volume: VolumeArgs,
        /// The generation.
        #[arg(long, value_name = "GENERATION")]
        generation: u64,
    },
    /// Forget a volume and every generation of it.
    Delete(VolumeArgs),
    /// Turn a project's cache volumes off at once: leases get empty views and
    /// publish nothing.
    Disable {
        /// The project [default: default].
        #[arg(long, value_name = "PROJECT")]
        project: Option<String>,
    },
    /// Turn a project's cache volumes back on.
    Enable {
        /// The project [default: default].
        #[arg(long, value_name = "PROJECT")]
        project: Option<String>,
    },
}

impl CacheArgs {
    pub(crate) async fn run(self) -> Result<(), CliError> {
        let connection = self.leases.connect(&self.client, self.client.credentials()?).await?;
        let mut client = CachesClient::new(connection.channel.clone());
        let format = self.client.output;
        let project = |project: Option<String>| project.unwrap_or_default();
        // Every call maps a refusal to the CLI's error the same way.
        macro_rules! call {
            ($method:ident, $request:expr) => {
                connection.answer(client.$method(connection.request($request))).await?
            };
        }
        let (json, text): (Box<dyn Fn() -> Result<(), CliError>>, String) = match self.command {
            CacheCommand::List(scope) => {
                let request =
                    v1::ListCachesRequest { project: project(scope.project), all_projects: scope.all_projects };
                let listed = call!(list_caches, request);
                if format == OutputFormat::Table && listed.volumes.is_empty() {
                    output::note("No cache volumes found.");
                    return Ok(());
                }
                let text = volumes_table(&listed.volumes);
                (Box::new(move || output::print_message(&listed)), text)
            }
            CacheCommand::Get(volume) => {
                let got = call!(get_cache, v1::GetCacheRequest { project: project(volume.project), key: volume.key });
                let text = details(&got);
                (Box::new(move || output::print_message(&got)), text)
            }
            CacheCommand::Rollback { volume, to } => {
                let request =
                    v1::SetCacheHeadRequest { project: project(volume.project), key: volume.key, generation: to };
                let moved = call!(set_cache_head, request);
                let head = moved.volume.as_ref().and_then(|v| v.head.as_ref()).map_or(0, |head| head.generation);
                let key = moved.volume.as_ref().map(|v| v.key.clone()).unwrap_or_default();
                let text = format!("cache volume {key}: new leases start from generation {head}\n");
                (Box::new(move || output::print_message(&moved)), text)
            }
            CacheCommand::Pin { volume, generation } => {
                let request = v1::PinCacheGenerationRequest {
                    project: project(volume.project),
                    key: volume.key.clone(),
                    generation,
                    pinned: true,
                };
                let pinned = call!(pin_cache_generation, request);
                let text =
                    format!("cache volume {}: generation {generation} pinned: it is never collected\n", volume.key);
                (Box::new(move || output::print_message(&pinned)), text)
            }
            CacheCommand::Unpin { volume, generation } => {
                let request = v1::PinCacheGenerationRequest {
                    project: project(volume.project),
                    key: volume.key.clone(),
                    generation,
                    pinned: false,
                };
                let unpinned = call!(pin_cache_generation, request);
                let text = format!("cache volume {}: generation {generation} unpinned\n", volume.key);
                (Box::new(move || output::print_message(&unpinned)), text)
            }
            CacheCommand::Delete(volume) => {
                let deleted = call!(
                    delete_cache,
                    v1::DeleteCacheRequest { project: project(volume.project), key: volume.key.clone() }
                );
                let text = format!("cache volume {} deleted: the next lease of it starts empty\n", volume.key);
                (Box::new(move || output::print_message(&deleted)), text)
            }
            CacheCommand::Disable { project: name } => {
                let set =
                    call!(set_project_caching, v1::SetProjectCachingRequest { project: project(name), enabled: false });
                let text = format!(
                    "cache volumes of project {} are off: leases get empty views and publish nothing\n",
                    set.project
                );
                (Box::new(move || output::print_message(&set)), text)
            }
            CacheCommand::Enable { project: name } => {
                let set =
                    call!(set_project_caching, v1::SetProjectCachingRequest { project: project(name), enabled: true });
                let text = format!("cache volumes of project {} are on\n", set.project);
                (Box::new(move || output::print_message(&set)), text)
            }
        };
        match format {
            OutputFormat::Json => json(),
            OutputFormat::Table => output::print(&text),
        }
    }
}

fn generation_text(generation: Option<&v1::CacheGeneration>) -> String {
    match generation {
        Some(head) if head.generation > 0 => head.generation.to_string(),
        _ => output::NONE.to_string(),
    }
}

/// The volumes as a table.
fn volumes_table(volumes: &[v1::CacheVolume]) -> String {
    let mut table = Table::new(vec!["PROJECT", "KEY", "HEAD", "GENERATIONS", "SIZE", "PUBLISHED", "STATE"]);
    for volume in volumes {
        let head = volume.head.as_ref();
        table.row(vec![
            volume.project.clone(),
            volume.key.clone(),
            generation_text(head),
            volume.generations.to_string(),
            output::memory(volume.size_bytes),
            head.and_then(|h| h.published_at.as_ref())
                .map_or_else(|| output::NONE.to_string(), |at| output::age(Some(at))),
            if volume.enabled { "on".to_string() } else { "off".to_string() },
        ]);
    }
    table.render()
}

/// One volume in full, and its generations.
fn details(got: &v1::GetCacheResponse) -> String {
    let volume = got.volume.clone().unwrap_or_default();
    let head = volume.head.as_ref();
    let rows: Vec<(&str, String)> = vec![
        ("Project", volume.project.clone()),
        ("Key", volume.key.clone()),
        ("Head", generation_text(head)),
        ("Head digest", output::or_none(head.map_or("", |h| h.digest.as_str()))),
        (
            "Head on",
            head.filter(|h| h.generation > 0).map_or_else(
                || output::NONE.to_string(),
                |h| {
                    std::iter::once(h.node_id.as_str())
                        .chain(h.held_by.iter().map(String::as_str))
                        .collect::<Vec<_>>()
                        .join(", ")
                },
            ),
        ),
        ("Generations", volume.generations.to_string()),
        ("Size", output::memory(volume.size_bytes)),
        ("Caching", if volume.enabled { "on".to_string() } else { "off for the project".to_string() }),
    ];
    let mut text = output::fields(&rows);
    let mut table = Table::new(vec!["GENERATION", "DIGEST", "SIZE", "LEASE", "NODE", "PUSHED", "AGE", "PINNED"]);
    for generation in &got.generations {
        let pushed = if generation.artifact.is_empty() {
            "no".to_string()
        } else {
            generation.artifact.chars().take(19).collect()
        };
        table.row(vec![
            generation.generation.to_string(),
            generation.digest.chars().take(19).collect(),
            output::memory(generation.size_bytes),
            generation.lease_id.clone(),
            generation.node_id.clone(),
            pushed,
            output::age(generation.published_at.as_ref()),
            if generation.pinned { "yes".to_string() } else { String::new() },
        ]);
    }
    text.push_str(&table.section("Generations", "<none>"));
    text
}
