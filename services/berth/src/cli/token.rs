//! `berth token create|list|revoke`: the join tokens an operator hands to
//! new hosts.
//!
//! # Invariants
//! A token's secret is printed once, by `create`; `list` and `revoke` never
//! see it (identity stores it hashed).

use std::collections::HashMap;

use berth_proto::identity::v1;
use berth_proto::identity::v1::join_tokens_client::JoinTokensClient;

use super::output;
use super::{CliError, ClientArgs, OutputFormat, parse_label, parse_ttl};

/// Flags of `berth token`.
#[derive(Debug, clap::Args)]
pub(crate) struct TokenArgs {
    #[command(flatten)]
    client: ClientArgs,
    #[command(subcommand)]
    command: TokenCommand,
}

#[derive(Debug, clap::Subcommand)]
enum TokenCommand {
    /// Create a join token; its secret is printed once, here.
    Create(CreateArgs),
    /// List join tokens, newest first, without their secrets.
    List(ListArgs),
    /// Revoke a join token: later joins with it are refused; nodes that
    /// already joined are not affected.
    Revoke {
        /// The token's id, as printed by `create` or `list`.
        #[arg(value_name = "TOKEN_ID")]
        token_id: String,
    },
}

#[derive(Debug, clap::Args)]
struct CreateArgs {
    /// The tier every node joining with the token is placed in, e.g. `gpu`.
    #[arg(long, value_name = "TIER")]
    tier: Option<String>,
    /// A label every node joining with the token receives; repeatable.
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_label)]
    labels: Vec<(String, String)>,
    /// How long the token stays usable, e.g. `30m`, `1h`, `3600s`
    /// [default: the server's, one hour].
    #[arg(long, value_name = "DURATION", value_parser = parse_ttl)]
    ttl: Option<u32>,
    /// How many joins the token allows [default: 1].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    max_uses: Option<u32>,
    /// A note for operators, e.g. "rack 4 reinstall".
    #[arg(long, value_name = "TEXT")]
    description: Option<String>,
}

#[derive(Debug, clap::Args)]
struct ListArgs {
    /// Only tokens that can still be used (not revoked, expired or used up).
    #[arg(long)]
    usable: bool,
}

impl TokenArgs {
    pub(crate) async fn run(self) -> Result<(), CliError> {
        let connection = self.client.connect()?;
        let mut client = JoinTokensClient::new(connection.channel.clone());
        let format = self.client.output;
        match self.command {
            TokenCommand::Create(args) => {
                let request = v1::CreateJoinTokenRequest {
                    tier: args.tier.unwrap_or_default(),
                    labels: args.labels.into_iter().collect::<HashMap<_, _>>(),
                    ttl_seconds: args.ttl.unwrap_or(0),
                    max_uses: args.max_uses.unwrap_or(0),
                    description: args.description.unwrap_or_default(),
                };
                let created = connection.answer(client.create_join_token(connection.request(request))).await?;
                print_created(&created, format)
            }
            TokenCommand::List(args) => {
                let listed =
                    connection
                        .answer(client.list_join_tokens(
                            connection.request(v1::ListJoinTokensRequest { usable_only: args.usable }),
                        ))
                        .await?;
                print_list(&listed, format)
            }
            TokenCommand::Revoke { token_id } => {
                let revoked = connection
                    .answer(client.revoke_join_token(connection.request(v1::RevokeJoinTokenRequest { token_id })))
                    .await?;
                let token = revoked.join_token.as_ref().ok_or(CliError::IncompleteResponse("the revoked token"))?;
                output::print_answer(format, &revoked, || format!("join token {} revoked\n", token.token_id))
            }
        }
    }
}

fn print_created(created: &v1::CreateJoinTokenResponse, format: OutputFormat) -> Result<(), CliError> {
    match format {
        OutputFormat::Json => output::print_message(created),
        OutputFormat::Table => {
            let expires = created.expires_at.as_ref();
            output::print(&format!(
                "Token:     {}\nToken ID:  {}\nExpires:   {}\n",
                created.token,
                created.token_id,
                output::when(expires, &output::until(expires)),
            ))?;
            output::note(
                "\nThe token is shown only this once. Give it to the new host's agent: berth-agent --join-token TOKEN",
            );
            Ok(())
        }
    }
}

fn print_list(listed: &v1::ListJoinTokensResponse, format: OutputFormat) -> Result<(), CliError> {
    let headers = vec!["ID", "STATUS", "USES", "TIER", "LABELS", "EXPIRES", "AGE", "CREATED-BY", "DESCRIPTION"];
    output::print_listed(listed, &listed.join_tokens, "join tokens", format, headers, |token| {
        vec![
            token.token_id.clone(),
            status(token).to_string(),
            format!("{}/{}", token.uses, token.max_uses),
            output::or_none(&token.tier),
            output::labels(&token.labels),
            output::until(token.expires_at.as_ref()),
            output::age(token.created_at.as_ref()),
            output::or_none(&token.created_by),
            token.description.clone(),
        ]
    })
}

/// Whether the token can still be used, and if not, the first reason why.
fn status(token: &v1::JoinToken) -> &'static str {
    let expired = token.expires_at.as_ref().is_some_and(output::is_past);
    if token.revoked {
        "revoked"
    } else if expired {
        "expired"
    } else if token.max_uses > 0 && token.uses >= token.max_uses {
        "used-up"
    } else {
        "usable"
    }
}
