package refgrant

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/utils/ptr"
	gatewayv1 "sigs.k8s.io/gateway-api/apis/v1"
	gatewayv1beta1 "sigs.k8s.io/gateway-api/apis/v1beta1"
	gatewayfake "sigs.k8s.io/gateway-api/pkg/client/clientset/versioned/fake"
)

var (
	snapshot = Target{Namespace: "src", Group: "snapshot.storage.k8s.io", Kind: "VolumeSnapshot", Name: "snap"}
	claim    = Target{Namespace: "src", Group: "", Kind: "PersistentVolumeClaim", Name: "data"}
)

// grant is a grant in namespace ns from the claims of fromNS to the kind of to, named
// name ("" for any).
func grant(ns, fromNS string, to Target, name string) *gatewayv1beta1.ReferenceGrant {
	g := &gatewayv1beta1.ReferenceGrant{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "grant"},
		Spec: gatewayv1beta1.ReferenceGrantSpec{
			From: []gatewayv1beta1.ReferenceGrantFrom{{Group: "", Kind: "PersistentVolumeClaim", Namespace: gatewayv1.Namespace(fromNS)}},
			To:   []gatewayv1beta1.ReferenceGrantTo{{Group: gatewayv1.Group(to.Group), Kind: gatewayv1.Kind(to.Kind)}},
		},
	}
	if name != "" {
		g.Spec.To[0].Name = ptr.To(gatewayv1.ObjectName(name))
	}
	return g
}

func TestAGrantAllowsOnlyTheClaimsAndSourcesItNames(t *testing.T) {
	change := func(g *gatewayv1beta1.ReferenceGrant, f func(*gatewayv1beta1.ReferenceGrant)) *gatewayv1beta1.ReferenceGrant {
		f(g)
		return g
	}
	for _, tc := range []struct {
		name   string
		grants []*gatewayv1beta1.ReferenceGrant
		to     Target
		want   bool
	}{
		{name: "no grant", to: snapshot},
		{name: "snapshot, any name", grants: []*gatewayv1beta1.ReferenceGrant{grant("src", "dst", snapshot, "")}, to: snapshot, want: true},
		{name: "snapshot, its name", grants: []*gatewayv1beta1.ReferenceGrant{grant("src", "dst", snapshot, "snap")}, to: snapshot, want: true},
		{name: "snapshot, another name", grants: []*gatewayv1beta1.ReferenceGrant{grant("src", "dst", snapshot, "other")}, to: snapshot},
		{name: "claim, any name", grants: []*gatewayv1beta1.ReferenceGrant{grant("src", "dst", claim, "")}, to: claim, want: true},
		{name: "claim, its name", grants: []*gatewayv1beta1.ReferenceGrant{grant("src", "dst", claim, "data")}, to: claim, want: true},
		{name: "a grant for claims does not allow snapshots", grants: []*gatewayv1beta1.ReferenceGrant{grant("src", "dst", claim, "")}, to: snapshot},
		{name: "a grant for snapshots does not allow claims", grants: []*gatewayv1beta1.ReferenceGrant{grant("src", "dst", snapshot, "")}, to: claim},
		{name: "grant in another namespace than the source", grants: []*gatewayv1beta1.ReferenceGrant{grant("elsewhere", "dst", snapshot, "")}, to: snapshot},
		{name: "grant from another namespace", grants: []*gatewayv1beta1.ReferenceGrant{grant("src", "third", snapshot, "")}, to: snapshot},
		{name: "from another kind", grants: []*gatewayv1beta1.ReferenceGrant{change(grant("src", "dst", snapshot, ""), func(g *gatewayv1beta1.ReferenceGrant) {
			g.Spec.From[0].Kind = "Gateway"
		})}, to: snapshot},
		{name: "from a claim kind of another group", grants: []*gatewayv1beta1.ReferenceGrant{change(grant("src", "dst", snapshot, ""), func(g *gatewayv1beta1.ReferenceGrant) {
			g.Spec.From[0].Group = "example.com"
		})}, to: snapshot},
		{name: "to the kind in another group", grants: []*gatewayv1beta1.ReferenceGrant{change(grant("src", "dst", snapshot, ""), func(g *gatewayv1beta1.ReferenceGrant) {
			g.Spec.To[0].Group = "example.com"
		})}, to: snapshot},
		{name: "an empty name is any name", grants: []*gatewayv1beta1.ReferenceGrant{change(grant("src", "dst", snapshot, ""), func(g *gatewayv1beta1.ReferenceGrant) {
			g.Spec.To[0].Name = ptr.To(gatewayv1.ObjectName(""))
		})}, to: snapshot, want: true},
		{name: "one of several froms and tos", grants: []*gatewayv1beta1.ReferenceGrant{change(grant("src", "third", claim, ""), func(g *gatewayv1beta1.ReferenceGrant) {
			g.Spec.From = append(g.Spec.From, gatewayv1beta1.ReferenceGrantFrom{Kind: "PersistentVolumeClaim", Namespace: "dst"})
			g.Spec.To = append(g.Spec.To, gatewayv1beta1.ReferenceGrantTo{Group: "snapshot.storage.k8s.io", Kind: "VolumeSnapshot"})
		})}, to: snapshot, want: true},
		{name: "from and to must be in one grant", grants: []*gatewayv1beta1.ReferenceGrant{
			grant("src", "dst", claim, ""),
			grant("src", "third", snapshot, ""),
		}, to: snapshot},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Allows(tc.grants, "dst", tc.to); got != tc.want {
				t.Errorf("Allows = %v, want %v", got, tc.want)
			}
		})
	}
}

// changes records the namespaces a Watch says changed.
type changes struct {
	mu   sync.Mutex
	seen []string
}

func (c *changes) add(ns string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.seen = append(c.seen, ns)
}

func (c *changes) has(ns string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, s := range c.seen {
		if s == ns {
			return true
		}
	}
	return false
}

func startWatch(t *testing.T, client *gatewayfake.Clientset) (*Watch, *changes) {
	t.Helper()
	ch := &changes{}
	w, err := New(client, nil, ch.add)
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) })
	w.Start(stop)
	return w, ch
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	if err := wait.PollUntilContextTimeout(context.Background(), 5*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return cond(), nil
	}); err != nil {
		t.Fatalf("waiting for %s: %v", what, err)
	}
}

func TestAGrantThatAppearsIsToldAtOnceAndAllows(t *testing.T) {
	client := gatewayfake.NewClientset()
	w, ch := startWatch(t, client)
	waitFor(t, "the grants read", w.Answered)
	if err := w.Check("dst", snapshot); !errors.Is(err, ErrNotGranted) {
		t.Fatalf("Check without a grant = %v, want ErrNotGranted", err)
	}
	if _, err := client.GatewayV1beta1().ReferenceGrants("src").Create(context.Background(), grant("src", "dst", snapshot, ""), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the grant's namespace told", func() bool { return ch.has("src") })
	if err := w.Check("dst", snapshot); err != nil {
		t.Errorf("Check with a grant = %v, want nil", err)
	}
	if err := w.Check("third", snapshot); !errors.Is(err, ErrNotGranted) {
		t.Errorf("Check from a namespace the grant does not name = %v, want ErrNotGranted", err)
	}
}

// A cluster without the CRD, or an RBAC without the grants, answers at once: the caller
// need not wait, and each refused claim learns what is missing.
func TestWhatIsMissingIsSaidAndNothingWaitsForIt(t *testing.T) {
	gr := schema.GroupResource{Group: "gateway.networking.k8s.io", Resource: "referencegrants"}
	for _, tc := range []struct {
		name string
		err  error
		want string
	}{
		{name: "no CRD", err: apierrors.NewNotFound(gr, ""), want: "install the Gateway API's ReferenceGrant CRD"},
		{name: "no permission", err: apierrors.NewForbidden(gr, "", errors.New("RBAC: access denied")), want: "grant get, list and watch"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client := gatewayfake.NewClientset()
			var mu sync.Mutex
			refuse := true
			reactor := func(k8stesting.Action) (bool, runtime.Object, error) {
				mu.Lock()
				defer mu.Unlock()
				if refuse {
					return true, nil, tc.err
				}
				return false, nil, nil
			}
			client.PrependReactor("list", "referencegrants", reactor)
			client.PrependWatchReactor("referencegrants", func(a k8stesting.Action) (bool, watch.Interface, error) {
				handled, _, err := reactor(a)
				return handled, nil, err
			})
			w, _ := startWatch(t, client)
			waitFor(t, "the refusal heard", w.Answered)
			if err := w.Check("dst", snapshot); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Check = %v, want an error saying %q", err, tc.want)
			}
			// Installed or granted later: the reflector's retry reads the grants.
			mu.Lock()
			refuse = false
			mu.Unlock()
			if _, err := client.GatewayV1beta1().ReferenceGrants("src").Create(context.Background(), grant("src", "dst", snapshot, ""), metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			waitFor(t, "the grant allowing", func() bool { return w.Check("dst", snapshot) == nil })
		})
	}
}
