//! Each operation's problem answers: the codes it may answer with, by status, from one table.

use std::collections::BTreeMap;

use idem_http::ProblemCode;
use utoipa::Modify;
use utoipa::openapi::path::{Operation, PathItem};
use utoipa::openapi::schema::{AllOfBuilder, ObjectBuilder, Type};
use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};

use ProblemCode as P;

/// A caller the API keys do not know.
const AUTH: &[P] = &[P::Unauthorized];
/// A JSON body that cannot be read.
const BODY: &[P] = &[
    P::UnsupportedMediaType,
    P::MalformedJson,
    P::InvalidRequest,
    P::BodyTooLarge,
];
/// A path parameter that does not decode.
const PATH: &[P] = &[P::InvalidPath];
/// A store that fails.
const STORE: &[P] = &[P::StoreUnavailable, P::StoreError, P::StoreFull];
/// The record tools' gate.
const ADMIN: &[P] = &[
    P::Unauthorized,
    P::AdminDisabled,
    P::RecordToolsUnsupported,
    P::InvalidRequest,
];
/// A count of ids.
const COUNT: &[P] = &[P::InvalidCount, P::InvalidRequest];

/// The problems each operation may answer with, by method and path.
const ERRORS: &[(&str, &str, &[&[P]])] = &[
    ("get", "/healthz", &[&[P::StoreUnavailable]]),
    ("get", "/_idem/health", &[&[P::StoreUnavailable]]),
    ("get", "/_idem", &[&[P::AdminDisabled]]),
    (
        "post",
        "/v1/records/begin",
        &[
            AUTH,
            BODY,
            STORE,
            &[
                P::InvalidKey,
                P::InvalidFingerprint,
                P::InvalidDuration,
                P::InvalidStep,
                P::InProgress,
                P::FingerprintMismatch,
            ],
        ],
    ),
    (
        "post",
        "/v1/records/step",
        &[
            AUTH,
            BODY,
            STORE,
            &[
                P::InvalidKey,
                P::InvalidLease,
                P::InvalidStep,
                P::StaleLease,
                P::StepConflict,
                P::StepAfterUnknown,
                P::StepsFull,
            ],
        ],
    ),
    (
        "post",
        "/v1/records/complete",
        &[
            AUTH,
            BODY,
            STORE,
            &[P::InvalidKey, P::InvalidLease, P::StaleLease],
        ],
    ),
    (
        "post",
        "/v1/records/release",
        &[
            AUTH,
            BODY,
            STORE,
            &[P::InvalidKey, P::InvalidLease, P::StaleLease],
        ],
    ),
    (
        "post",
        "/v1/records/renew",
        &[
            AUTH,
            BODY,
            STORE,
            &[
                P::InvalidKey,
                P::InvalidLease,
                P::InvalidDuration,
                P::StaleLease,
            ],
        ],
    ),
    (
        "get",
        "/v1/records/{namespace}/{key}",
        &[
            AUTH,
            PATH,
            STORE,
            &[P::InvalidKey, P::InvalidRequest, P::NotFound],
        ],
    ),
    (
        "post",
        "/v1/tokens",
        &[AUTH, BODY, STORE, &[P::InvalidDuration]],
    ),
    (
        "post",
        "/v1/tokens/consume",
        &[
            AUTH,
            BODY,
            STORE,
            &[
                P::TokenAlreadyUsed,
                P::TokenExpired,
                P::TokenWrongPurpose,
                P::TokenUnknown,
            ],
        ],
    ),
    (
        "post",
        "/v1/locks/{name}/acquire",
        &[
            AUTH,
            PATH,
            BODY,
            STORE,
            &[
                P::LocksUnsupported,
                P::InvalidLockName,
                P::InvalidLease,
                P::InvalidWait,
                P::InvalidOwner,
                P::LockHeld,
                P::NotOwner,
                P::LockError,
            ],
        ],
    ),
    (
        "post",
        "/v1/locks/{name}/renew",
        &[
            AUTH,
            PATH,
            BODY,
            STORE,
            &[
                P::LocksUnsupported,
                P::InvalidLockName,
                P::InvalidLease,
                P::InvalidLock,
                P::LockHeld,
                P::NotOwner,
                P::LockError,
            ],
        ],
    ),
    (
        "post",
        "/v1/locks/{name}/release",
        &[
            AUTH,
            PATH,
            BODY,
            STORE,
            &[
                P::LocksUnsupported,
                P::InvalidLockName,
                P::InvalidLock,
                P::LockHeld,
                P::NotOwner,
                P::LockError,
            ],
        ],
    ),
    ("get", "/v1/ids/uuid7", &[AUTH, COUNT]),
    (
        "get",
        "/v1/ids/snowflake",
        &[
            AUTH,
            COUNT,
            &[
                P::NoWorkerId,
                P::WorkerLeaseExpired,
                P::WorkerLost,
                P::IdsUnavailable,
                P::IdsBusy,
            ],
        ],
    ),
    (
        "get",
        "/v1/ids/segment/{tag}",
        &[
            AUTH,
            PATH,
            COUNT,
            STORE,
            &[P::InvalidTag, P::TagQuotaExceeded, P::TooManyTags],
        ],
    ),
    ("get", "/_idem/records", &[ADMIN, STORE]),
    ("get", "/_idem/records/counts", &[ADMIN, STORE]),
    (
        "get",
        "/_idem/records/show",
        &[ADMIN, STORE, &[P::RecordNotFound]],
    ),
    ("get", "/_idem/records/history", &[ADMIN]),
    (
        "get",
        "/_idem/segments",
        &[&[P::Unauthorized, P::AdminDisabled]],
    ),
    (
        "get",
        "/_idem/locks",
        &[
            &[P::Unauthorized, P::AdminDisabled, P::LocksUnsupported],
            STORE,
        ],
    ),
    // With --metrics-require-token.
    (
        "get",
        "/_idem/metrics",
        &[&[P::Unauthorized, P::AdminDisabled]],
    ),
    (
        "post",
        "/_idem/records/repair",
        &[ADMIN, BODY, STORE, &[P::ForceRequired, P::InternalRecord]],
    ),
];

/// Adds each operation's problem answers from [`ERRORS`]: one response a status, whose `code`
/// is one of those the operation answers with at that status.
pub(super) struct Errors;

impl Modify for Errors {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        for (method, path, groups) in ERRORS {
            let Some(op) = doc
                .paths
                .paths
                .get_mut(*path)
                .and_then(|item| operation(item, method))
            else {
                continue;
            };
            let mut by_status: BTreeMap<u16, Vec<P>> = BTreeMap::new();
            for code in groups.iter().flat_map(|g| g.iter()) {
                let codes = by_status.entry(code.status().as_u16()).or_default();
                if !codes.contains(code) {
                    codes.push(*code);
                }
            }
            for (status, codes) in by_status {
                op.responses
                    .responses
                    .insert(status.to_string(), problem_response(status, &codes).into());
            }
        }
    }
}

fn operation<'a>(item: &'a mut PathItem, method: &str) -> Option<&'a mut Operation> {
    match method {
        "get" => item.get.as_mut(),
        "post" => item.post.as_mut(),
        _ => None,
    }
}

/// A problem+json response of `status` whose `code` is one of `codes`.
fn problem_response(status: u16, codes: &[P]) -> utoipa::openapi::Response {
    let description = codes
        .iter()
        .map(|c| format!("`{}`: {}", c.as_str(), c.meaning()))
        .collect::<Vec<_>>()
        .join("\n\n");
    let narrowed = ObjectBuilder::new()
        .property(
            "code",
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some(codes.iter().map(|c| c.as_str()))),
        )
        .property(
            "status",
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .enum_values(Some([status])),
        );
    let schema = AllOfBuilder::new()
        .item(Ref::from_schema_name("Problem"))
        .item(narrowed);
    ResponseBuilder::new()
        .description(description)
        .content(
            "application/problem+json",
            ContentBuilder::new().schema(Some(schema)).build(),
        )
        .build()
}
