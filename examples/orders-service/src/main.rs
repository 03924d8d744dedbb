//! Runs the order service on 127.0.0.1:3000 with records in `orders-idem.db`.

use std::sync::Arc;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store = Arc::new(idem_store::SqliteStore::open("orders-idem.db")?);
    let app = orders_service::app(store, orders_service::Orders::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    eprintln!("orders service on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
